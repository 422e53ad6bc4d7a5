"""Reconnect storms (issue 14, point 3): how pumps share the loop (turns.py), without a broker.

RunSizes and ReplayTurns on their own, then real pumps of one engine (real LevelDB store, in-memory
transports that acknowledge as a client does): sessions attached together each get their first
batch within attach and then take turns, instead of one session's whole window after another's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.turns import FIRST_RUN, ReplayTurns, RunSizes
from recording_transport import RecordingTransport, parse_packets

LIMIT = 10.0


def test_run_sizes_start_small_and_double_up_to_the_window() -> None:
    runs = RunSizes(100)
    sizes = []
    for _ in range(7):
        sizes.append((runs.next, runs.first))
        runs.sent()
    assert FIRST_RUN == 8
    assert sizes == [(8, True), (16, False), (32, False), (64, False), (100, False), (100, False), (100, False)]
    small = RunSizes(5)
    assert small.next == 5, "never more than the window"
    small.sent()
    assert small.next == 5
    assert RunSizes(1).next == 1


def test_a_turn_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReplayTurns(0)


def test_a_lone_pump_gets_its_turns_at_once_once_per_pass() -> None:
    async def main() -> None:
        turns = ReplayTurns(budget=100)
        assert turns.try_take(25, first=False)
        had = turns.pass_id
        assert turns.try_take(25, first=False, last=had) is False, "one turn per pass for a pump"
        await asyncio.sleep(0)  # the next pass (a grant starts one)
        assert turns.pass_id == had + 1
        assert turns.try_take(25, first=False, last=had), "no one waits, budget left: at once"
        assert turns.try_take(75, first=False) and turns.try_take(1, first=False) is False, "budget used up"

    asyncio.run(main())


def test_waiting_pumps_get_turns_round_robin_at_most_the_budget_per_pass() -> None:
    async def main() -> None:
        turns = ReplayTurns(budget=30)
        granted: list[tuple[str, int]] = []

        async def pump(name: str, batches: int) -> None:
            last = None
            for _ in range(batches):
                await turns.take(10, first=False, last=last)
                last = turns.pass_id
                granted.append((name, last))

        await asyncio.wait_for(asyncio.gather(*(pump(name, 4) for name in "abcde")), LIMIT)
        order = "".join(name for name, _ in granted)
        assert order == "abcde" * 4, "every pump's k-th turn before any pump's (k+1)-th"
        per_pass: dict[int, int] = {}
        for _, at in granted:
            per_pass[at] = per_pass.get(at, 0) + 10
        assert max(per_pass.values()) <= 30, per_pass
        assert turns.waiting == 0

    asyncio.run(main())


async def _three_waiting(turns: ReplayTurns) -> list[asyncio.Future[None]]:
    """Three pumps asking for a later batch's turn (10 messages) in a pass whose budget (10) is
    used up: the next pass grants the first, the other two still wait."""
    asked = [asyncio.ensure_future(turns.take(10, first=False)) for _ in range(3)]  # they ask in the next pass
    assert turns.try_take(10, first=False), "this pass's budget"
    await asyncio.sleep(0)
    assert turns.waiting == 2
    return asked


def test_a_first_batch_gets_its_turn_at_once_while_later_ones_wait() -> None:
    async def main() -> None:
        turns = ReplayTurns(budget=10)
        asked = await _three_waiting(turns)
        assert turns.try_take(FIRST_RUN, first=True), "a session's first batch never waits"
        assert turns.try_take(1, first=False) is False, "a later one queues behind the waiting ones"
        await asyncio.wait_for(asyncio.gather(*asked), LIMIT)

    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_queue() -> None:
    async def main() -> None:
        turns = ReplayTurns(budget=10)
        asked = await _three_waiting(turns)
        asked[1].cancel()
        await asyncio.gather(asked[1], return_exceptions=True)
        assert asked[1].cancelled()
        await asyncio.wait_for(asyncio.gather(asked[0], asked[2]), LIMIT)
        assert turns.waiting == 0

    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_queue_at_once() -> None:
    """A pump stopped while it waits leaves the queue as its task is cancelled, not only when a
    later pass reaches it: ``waiting`` no longer counts it. (Cancelling the task cancels the future
    it awaits too, so the queue entry was kept while it was "done", until a pass skipped it.)"""

    async def main() -> None:
        turns = ReplayTurns(budget=10)
        asked = [asyncio.ensure_future(turns.take(10, first=False)) for _ in range(8)]  # next pass
        assert turns.try_take(10, first=False), "this pass's budget"
        await asyncio.sleep(0)
        assert turns.waiting == 7, "the next pass granted one turn of 10 (its budget)"
        since = turns.pass_id
        asked[-1].cancel()  # the last in the queue: each pass grants one, far from it
        await asyncio.gather(asked[-1], return_exceptions=True)
        granted = turns.pass_id - since
        assert granted < 6, "no pass reached the cancelled one"
        assert turns.waiting == 7 - granted - 1
        for waiting in asked[:-1]:
            waiting.cancel()
        await asyncio.gather(*asked, return_exceptions=True)
        assert turns.waiting == 0

    asyncio.run(main())


class OrderedTransport(RecordingTransport):
    """A client that acknowledges each write's PUBLISHes in the loop pass after it, as one run,
    and logs (its name, the payloads) of every write in one list shared by all transports."""

    def __init__(self, name: str, log: list[tuple[str, list[bytes]]]) -> None:
        super().__init__()
        self.name = name
        self.log = log
        self.ack_runs = None

    def write(self, data: bytes) -> None:
        super().write(data)
        publishes = [p for p in parse_packets(data) if p.packet_type == 3]
        if publishes:
            self.log.append((self.name, [p.payload for p in publishes]))
        ids = [p.packet_id for p in publishes if p.packet_id is not None]
        if ids:
            asyncio.get_running_loop().call_soon(self._ack, ids)

    def _ack(self, ids: list[int]) -> None:
        runs = self.ack_runs
        if runs is None or self.closed:
            return
        runs.begin_ack_run()
        assert runs.take_pubacks(ids) == []
        runs.end_ack_run()


def test_sessions_attached_together_get_their_first_batch_within_attach_then_take_turns(tmp_path: Path) -> None:
    """20 sessions with 300 queued each attach in one pass. Each one's first batch (FIRST_RUN) is
    written within its attach; then every session gets its second batch before any gets a third
    (turns in order, a small budget per pass), and each session gets its whole queue in order, once."""
    sessions, queued, window = 20, 300, 100

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window))
        engine.open()
        engine.replay_turns = ReplayTurns(budget=40)
        names = [f"c{i}" for i in range(sessions)]
        try:
            for name in names:
                await engine.connect(name, clean_session=False)
                await engine.subscribe(name, f"t/{name}", 1)
            for index in range(queued):
                for name in names:
                    assert engine.route_publish(f"t/{name}", b"%d" % index, 1) is not None
            await engine.written_so_far()
            log: list[tuple[str, list[bytes]]] = []
            transports = {name: OrderedTransport(name, log) for name in names}

            async def attach(name: str) -> int:
                await engine.attach(name, transports[name])
                return len(transports[name].packets)

            within = await asyncio.gather(*(attach(name) for name in names))
            assert within == [FIRST_RUN] * sessions, "each first batch went out within attach"
            for transport in transports.values():
                sent = await transport.wait_for(lambda ps: len(ps) >= queued, LIMIT)
                assert [p.payload for p in sent] == [b"%d" % i for i in range(queued)], "in order, none twice"
            writes = [name for name, _ in log]
            assert sorted(writes[:sessions]) == sorted(names), "every first batch before any second one"
            assert [len(payloads) for _, payloads in log[:sessions]] == [FIRST_RUN] * sessions
            assert sorted(writes[sessions : 2 * sessions]) == sorted(names), (
                "every session's second batch before any session's third: turns in order"
            )
            for name in names:
                await engine.detach(name, transports[name])
        finally:
            await engine.close()

    asyncio.run(main())
