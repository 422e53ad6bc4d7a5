"""Store writes that fail (disk full, I/O error) and recover, without a broker.

The GroupCommitter is driven over a real LevelDB: a write fails because its handle was closed
(plyvel raises, as for any failed write) and the committer's own ``reopen`` hook, set by the
test as the engine sets it, hands out a fresh handle. The last test fills a real tmpfs.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from small_disk import fill, small_disk

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine, StoreHealth
from amqtt_durable.errors import StoreUnavailableError
from amqtt_durable.store import Body, GroupCommitter, body_key, iter_entries, iter_sessions, open_store

GENEROUS = 10.0
RETRY_FIRST_HERE = 0.1
"""The committers' first retry after a failed write (the broker's is RETRY_FIRST, 0.25 s); it doubles either way."""


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def one_pass() -> None:
    await asyncio.sleep(0)


class Reopener:
    """The committer's reopen hook over a real store folder, closing the handle in use first as the
    engine's does; it fails ``failures`` times before that."""

    def __init__(self, db: Any, path: str, failures: int = 0) -> None:
        self.path = path
        self.failures = failures
        self.calls: list[float] = []
        self.handles: list[Any] = [db]

    def __call__(self) -> Any:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise OSError(errno.ENOSPC, "No space left on device")
        if not self.handles[-1].closed:
            self.handles[-1].close()
        handle = open_store(self.path, create=False)
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        for handle in self.handles:
            if not handle.closed:
                handle.close()


def make(db: Any, reopen: Reopener, health: list[tuple[str, float]], *, sync: bool = False) -> GroupCommitter:
    committer = GroupCommitter(
        db, sync=sync, batch_size=5000, batch_delay_ms=60_000.0, pending_threshold=100, retry_first=RETRY_FIRST_HERE
    )
    committer.reopen = reopen
    committer.on_health = lambda error, since: health.append(("failing" if error else "ok", since))
    return committer


@pytest.mark.parametrize("sync", [False, True], ids=["in-loop", "fsync-in-thread"])
def test_a_failed_batch_is_kept_and_written_by_the_retry_with_its_callbacks_in_order(
    db: Any, store_path: str, sync: bool
) -> None:
    reopen = Reopener(db, store_path)
    health: list[tuple[str, float]] = []
    order: list[str] = []

    async def main() -> None:
        committer = make(db, reopen, health, sync=sync)
        committer.put(b"a", b"1")
        patient = committer.commit(lambda: order.append("a"))
        committer.put(b"b", b"1")
        publish = committer.commit(lambda: order.append("b"), urgent=True, fail_fast=True)
        db.close()  # the next write fails, as on a full disk
        with pytest.raises(StoreUnavailableError, match="cannot write"):
            await asyncio.wait_for(publish, GENEROUS)
        assert not patient.done(), "a commit that is not fail-fast waits for the retry"
        assert order == [], "nothing is delivered before it is written"
        assert committer.failure is not None
        assert [status for status, _ in health] == ["failing"]

        # While failing: more work queues behind the failed batch; a fail-fast commit fails at once.
        committer.put(b"a", b"2")
        committer.delete(b"b")
        committer.put(b"c", b"1")
        later = committer.commit(lambda: order.append("later"), fail_fast=True)
        assert later.done() and isinstance(later.exception(), StoreUnavailableError)
        committer.flush_soon()
        await one_pass()
        assert reopen.calls == [], "nothing is written before the retry's back-off"

        await asyncio.wait_for(patient, GENEROUS)
        assert len(reopen.calls) == 1, "the retry reopens the store first"
        assert order == ["a", "b", "later"], "callbacks of the failed batch run once written, in order"
        assert committer.failure is None
        assert [status for status, _ in health] == ["failing", "ok"]
        assert health[0][1] == health[1][1], "'ok' reports when the failures began"
        fresh = reopen.handles[1]
        assert (fresh.get(b"a"), fresh.get(b"b"), fresh.get(b"c")) == (b"2", None, b"1")

        committer.put(b"d", b"1")
        await asyncio.wait_for(committer.commit(urgent=True, fail_fast=True), GENEROUS)
        assert fresh.get(b"d") == b"1", "after recovery commits go to the new handle, fail-fast ones succeed"

    try:
        run(main)
    finally:
        reopen.close()


def test_retries_back_off_while_the_store_stays_unwritable(db: Any, store_path: str) -> None:
    reopen = Reopener(db, store_path, failures=3)
    health: list[tuple[str, float]] = []

    async def main() -> None:
        committer = make(db, reopen, health)
        committer.put(b"k", b"v")
        done = committer.commit(urgent=True)
        db.close()
        await asyncio.wait_for(done, GENEROUS)
        gaps = [later - earlier for earlier, later in zip(reopen.calls, reopen.calls[1:], strict=False)]
        assert len(reopen.calls) == 4
        assert gaps[0] >= 1.5 * RETRY_FIRST_HERE and gaps[2] > gaps[1] > gaps[0], f"no back-off: {gaps}"
        assert [status for status, _ in health] == ["failing", "ok"], "one report per change, not per retry"
        assert reopen.handles[1].get(b"k") == b"v"

    try:
        run(main)
    finally:
        reopen.close()


def test_when_failing_resolves_as_writes_start_failing_and_at_once_while_they_fail(db: Any, store_path: str) -> None:
    """What a clean CONNECT waits on beside its session's deletion (lifecycle): the first failed write
    resolves it; while writes fail a new one is resolved already; a cancelled one is forgotten."""
    reopen = Reopener(db, store_path)
    health: list[tuple[str, float]] = []

    async def main() -> None:
        committer = make(db, reopen, health)
        failing = committer.when_failing()
        forgotten = committer.when_failing()
        forgotten.cancel()
        committer.put(b"k", b"v")
        written = committer.commit(urgent=True)
        await asyncio.wait_for(written, GENEROUS)
        assert not failing.done(), "a write that succeeds resolves nothing"
        committer.put(b"k", b"w")
        patient = committer.commit(urgent=True)
        reopen.handles[-1].close()  # the next write fails, as on a full disk
        await asyncio.wait_for(failing, GENEROUS)
        assert not patient.done() and committer.failure is not None
        assert committer.when_failing().done(), "while writes fail: at once"
        assert committer._failing_waiters == set(), "none kept once resolved or cancelled"
        await asyncio.wait_for(patient, GENEROUS)
        assert not committer.when_failing().done(), "writes succeed again"

    try:
        run(main)
    finally:
        reopen.close()


def test_failure_of_before_flush_is_retried_like_a_failed_write(db: Any, store_path: str) -> None:
    reopen = Reopener(db, store_path)
    health: list[tuple[str, float]] = []

    async def main() -> None:
        committer = make(db, reopen, health)
        calls: list[int] = []

        def totals() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("totals went wrong")
            committer.put(b"totals", b"%d" % len(calls))

        committer.before_flush = totals
        committer.put(b"k", b"v")
        await asyncio.wait_for(committer.commit(urgent=True), GENEROUS)
        assert reopen.handles[1].get(b"k") == b"v" and reopen.handles[1].get(b"totals") == b"2"
        assert [status for status, _ in health] == ["failing", "ok"]

    try:
        run(main)
    finally:
        reopen.close()


def test_drain_at_close_writes_what_waits_if_the_store_came_back(db: Any, store_path: str) -> None:
    reopen = Reopener(db, store_path)

    async def main() -> None:
        committer = make(db, reopen, [])
        committer.put(b"k", b"v")
        pending = committer.commit(urgent=True)
        db.close()
        await one_pass()
        assert committer.failure is not None and not pending.done()
        await committer.drain()
        assert reopen.handles[1].get(b"k") == b"v"
        assert pending.done() and pending.exception() is None

    try:
        run(main)
    finally:
        reopen.close()


def test_drain_at_close_with_the_store_still_failing_says_what_is_not_stored(
    db: Any, store_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    reopen = Reopener(db, store_path, failures=1)

    async def main() -> None:
        committer = make(db, reopen, [])
        committer.put(b"k", b"v")
        committer.commit(urgent=True)
        db.close()
        await one_pass()
        assert committer.failure is not None
        with caplog.at_level(logging.WARNING, logger="amqtt_durable"):
            await committer.drain()
        assert "still failing" in caplog.text and "1 pending write(s) are not stored" in caplog.text

    run(main)


def test_after_a_full_disk_every_acknowledged_publish_survives_a_restart(tmp_path: Path) -> None:
    """On a real full disk LevelDB leaves a torn record in its log: anything written after it with
    the same handle is lost when the log is replayed at the next start (checked by hand: a store
    that then does not even open). The store is therefore reopened before the retry."""
    with small_disk(tmp_path / "disk", 8) as disk:
        store = str(disk / "store")
        acked: list[bytes] = []
        unacked: list[bytes] = []
        health: list[StoreHealth] = []

        async def publish(engine: DurableEngine, payload: bytes) -> bool:
            try:
                stored = engine.route_publish("t/x", payload, 1)
                assert stored is not None
                await stored
            except StoreUnavailableError:
                unacked.append(payload)
                return False
            acked.append(payload)
            return True

        async def main() -> None:
            recovered = asyncio.Event()

            def note(change: StoreHealth) -> None:
                health.append(change)
                if change.status == "ok":
                    recovered.set()

            engine = DurableEngine(DurableConfig(store=store), on_store_health=note)
            engine.open()
            await engine.connect("offline", clean_session=False)
            await engine.subscribe("offline", "t/#", 1)
            for i in range(100):
                assert await publish(engine, b"before-%04d-" % i + os.urandom(1000))
            filler = fill(disk)
            for i in range(1000):  # the log's last page takes a few more; bounded
                if not await publish(engine, b"full-%04d-" % i + os.urandom(1000)):
                    break
            assert unacked, "a publish on a full disk must not be acknowledged"
            assert [h.status for h in health] == ["failing"]
            with pytest.raises(StoreUnavailableError):
                engine.route_publish("t/x", b"refused while failing", 1)
            filler.unlink()
            await asyncio.wait_for(recovered.wait(), GENEROUS)
            for i in range(200):
                assert await publish(engine, b"after-%04d-" % i + os.urandom(1000))
            assert [h.status for h in health] == ["failing", "ok"]
            assert health[1].failed_for is not None
            await engine.close()

        run(main)
        db = open_store(store, create=False)  # as at the next start: paranoid checks, log replayed
        try:
            sid = 1
            stored = [Body.decode(db.get(body_key(entry.msg_id))).payload for entry in iter_entries(db, sid)]
        finally:
            db.close()
        kept = [payload for payload in stored if payload in set(acked)]
        assert kept == acked, "every acknowledged publish is in the queue, in order"
        assert set(stored) <= set(acked) | set(unacked[:1]), "only the publish whose own write failed may be added"


def test_a_connect_whose_write_fails_is_refused_and_its_session_expires_like_a_disconnected_one(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")

    async def main() -> None:
        recovered = asyncio.Event()
        engine = DurableEngine(
            DurableConfig(store=store, session_expiry=60),
            on_store_health=lambda change: recovered.set() if change.status == "ok" else None,
        )
        engine.open()
        await engine.connect("kept", clean_session=False)
        await engine.subscribe("kept", "t/#", 1)
        engine.db.close()  # the next write fails, as on a full disk; the retry reopens the store
        with pytest.raises(StoreUnavailableError):
            await engine.connect("new", clean_session=False)
        session = engine.sessions["new"]
        assert session.record.expires_at is not None, "refused, so disconnected: its expiry clock runs"
        for clean in (False, True):  # a durable CONNECT, or a clean one that would delete a session
            with pytest.raises(StoreUnavailableError):
                await engine.connect("kept", clean_session=clean)
        assert await engine.connect("plain", clean_session=True) is False, "a clean CONNECT needs no write"
        kept = engine.sessions["kept"]
        before = (kept.depth, kept.next_seq, engine._next_msg_id)
        with pytest.raises(StoreUnavailableError):
            engine.route_publish("t/x", b"refused", 1)
        assert (kept.depth, kept.next_seq, engine._next_msg_id) == before, "a refused publish changes nothing"
        assert engine.route_publish("nobody/x", b"not stored anyway", 1) is None
        await asyncio.wait_for(recovered.wait(), GENEROUS)
        await engine.close()

    run(main)
    db = open_store(store, create=False)
    try:
        records = {record.client_id: record for record in iter_sessions(db)}
    finally:
        db.close()
    assert set(records) == {"kept", "new"}
    assert records["new"].expires_at is not None
