"""Reconnect storms (issue 14, point 3): how pumps share the loop (turns.py), without a broker.

RunSizes and ReplayTurns on their own, then real pumps of one engine (real LevelDB store, in-memory
transports that acknowledge as a client does): sessions attached together each get their first
batch within attach and then take turns, instead of one session's whole window after another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.delivery import LIVE_BUFFER, ReadAccess
from amqtt_durable.engine import DurableEngine
from amqtt_durable.turns import FIRST_RUN, TURN_BUDGET, ReplayTurns, RunSizes
from durable_client.protocol import MARKER_TOPIC, decode_frame, decode_marker
from recording_transport import RecordingTransport, Sent, parse_packets

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


class PassCounter:
    """Counts, per pass of the event loop, the messages of later batches (all but a session's first
    write) written: a callback that reschedules itself with call_soon runs once per pass and closes
    that pass's count."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.passes = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.most = max(self.most, self.now)
        self.now = 0
        self.passes += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> int:
        self._running = False
        self.most = max(self.most, self.now)
        return self.most


class CountingTransport(OrderedTransport):
    """An OrderedTransport that adds each later write's PUBLISHes to a PassCounter and sets ``done``
    once ``expected`` PUBLISHes came."""

    def __init__(self, name: str, counter: PassCounter, expected: int) -> None:
        super().__init__(name, [])
        self.counter = counter
        self.expected = expected
        self.received = 0
        self.done = asyncio.Event()

    def write(self, data: bytes) -> None:
        count = sum(1 for p in parse_packets(data) if p.packet_type == 3)
        if self.received:
            self.counter.now += count
        self.received += count
        if self.received >= self.expected:
            self.done.set()
        super().write(data)


async def _queued_sessions(engine: DurableEngine, sessions: int, queued: int, topic: str = "t/{name}") -> list[str]:
    names = [f"c{i}" for i in range(sessions)]
    for name in names:
        await engine.connect(name, clean_session=False)
        await engine.subscribe(name, topic.format(name=name), 1)
    for index in range(queued):
        for name in names:
            assert engine.route_publish(f"t/{name}/{index}", b"%d" % index, 1) is not None
        if index % 50 == 49:
            await engine.written_so_far()
    await engine.written_so_far()
    return names


@pytest.mark.parametrize(("sessions", "queued", "window"), [(300, 200, 20), (200, 300, 100)])
def test_later_batches_per_pass_of_the_loop_stay_within_the_documented_bound(
    tmp_path: Path, sessions: int, queued: int, window: int
) -> None:
    """docs/guarantees.md, Reconnect storms: one pass of the event loop writes at most 2 x (255 +
    window) messages of later batches (the turns of two budgets). Real pumps of one engine, every
    session attached at once, each client acknowledging a write in the next pass. A pump asked for
    a turn of its batch's size, then re-took a batch that by then could be a whole window (more
    acks had come): 1,280 messages in one pass at 300 x 200, window 20 (800 at 200 x 300, 100)."""
    bound = 2 * (TURN_BUDGET - 1 + window)

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window))
        engine.open()
        try:
            names = await _queued_sessions(engine, sessions, queued, "t/{name}/#")
            counter = PassCounter()
            transports = {name: CountingTransport(name, counter, queued) for name in names}
            await asyncio.gather(*(engine.attach(name, transports[name]) for name in names))
            async with asyncio.timeout(60):
                for transport in transports.values():
                    await transport.done.wait()
            most = counter.stop()
            assert all(t.received == queued for t in transports.values()), "each message once"
            assert most <= bound, f"{most} messages of later batches in one pass (bound {bound})"
            for name in names:
                await engine.detach(name, transports[name])
        finally:
            await engine.close()

    asyncio.run(main())


class WatchedTurns(ReplayTurns):
    """The real turns, recording the passes in which a pump (a batch of at most ``window``
    messages; the hog asks for more) was granted a turn, and calling ``on_queue`` once, when a
    pump queues for one (before it waits)."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.granted_in: set[int] = set()
        self.on_queue: Callable[[], None] | None = None

    def try_take(self, size: int, first: bool, last: int | None = None) -> bool:
        took = super().try_take(size, first, last)
        if took and size <= self.window:
            self.granted_in.add(self.pass_id)
        return took

    async def take(self, size: int, first: bool, last: int | None = None) -> None:
        if size > self.window or self.try_take(size, first, last):
            await super().take(size, first, last)
            return
        hook, self.on_queue = self.on_queue, None
        if hook is not None:
            hook()
        await super().take(size, first, last)
        self.granted_in.add(self.pass_id)


async def _hog(turns: ReplayTurns) -> None:
    """Another pump that asks for the whole budget every pass: every later batch waits for a
    turn (granted at the next pass, before the hog's)."""
    last = None
    while True:
        await turns.take(turns.budget, first=False, last=last)
        last = turns.pass_id


class PassTransport(OrderedTransport):
    """Records the turns' pass of every write after the first; ``acks``: False, the client
    acknowledges nothing."""

    def __init__(self, turns: ReplayTurns, acks: bool = True) -> None:
        super().__init__("c", [])
        self.turns = turns
        self.acks = acks
        self.later_writes_in: list[int] = []

    def write(self, data: bytes) -> None:
        if self.writes:
            self.later_writes_in.append(self.turns.pass_id)
        if self.acks:
            super().write(data)
        else:
            RecordingTransport.write(self, data)


@contextlib.asynccontextmanager
async def _subscribed_beside_a_hog(
    config: DurableConfig, topic_filter: str
) -> AsyncIterator[tuple[DurableEngine, WatchedTurns]]:
    """An open engine whose turns are WatchedTurns (window: the recovery buffer) with a hog asking
    for the whole budget every pass, and durable session c subscribed to ``topic_filter`` (QoS 1);
    on the way out the hog is cancelled and the engine closed."""
    engine = DurableEngine(config)
    engine.open()
    turns = engine.replay_turns = WatchedTurns(config.recovery_buffer)
    hog = asyncio.ensure_future(_hog(turns))
    try:
        await engine.connect("c", clean_session=False)
        await engine.subscribe("c", topic_filter, 1)
        yield engine, turns
    finally:
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        await engine.close()


def _assert_every_batch_went_out_in_a_pass_granted_to_it(transport: PassTransport, turns: WatchedTurns) -> None:
    late = [at for at in transport.later_writes_in if at not in turns.granted_in]
    assert not late, f"written in passes {late}, granted in {sorted(turns.granted_in)}"


def test_a_batch_goes_out_in_the_pass_its_turn_is_granted_in_behind_a_topic_acl(tmp_path: Path) -> None:
    """The turn is taken after the topic ACL is asked (and the sent mark stored), right before the
    write: a pump granted a turn and then asking the ACL per message wrote its batch passes later,
    in a pass whose budget it was not counted in."""
    window, queued = 100, 200

    async def allowed(topic: str) -> bool:  # an ACL plugin that answers in the next pass
        answer = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(answer.set_result, True)
        return bool(await answer)

    async def main() -> None:
        config = DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window)
        async with _subscribed_beside_a_hog(config, "t/#") as (engine, turns):
            for index in range(queued):
                engine.route_publish(f"t/{index}", b"%d" % index, 1)  # a topic each: the ACL is asked for each
            await engine.written_so_far()
            transport = PassTransport(turns)
            await engine.attach("c", transport, ReadAccess(allowed))
            sent = await transport.wait_for(lambda ps: len(ps) >= queued, LIMIT * 2)
            assert [p.payload for p in sent] == [b"%d" % i for i in range(queued)]
            assert len(transport.later_writes_in) >= 4, "batches of 16, 32, 64, ..."
            _assert_every_batch_went_out_in_a_pass_granted_to_it(transport, turns)
            await engine.detach("c", transport)

    asyncio.run(main())


def test_a_turn_whose_batch_overflow_dropped_is_not_used_by_a_later_batch(tmp_path: Path) -> None:
    """A pump's batch waits for its turn; meanwhile publishes past max_depth drop it (drop-oldest,
    the oldest not in flight) and one still uncommitted, so the messages after it are read from the
    store later. The pump then had a granted turn and nothing to send: its next batch read from the
    store must take a turn of its own, not go out on the stale one (in a later pass, uncounted)."""
    window, depth = 100, 24

    async def main() -> None:
        config = DurableConfig(
            store=str(tmp_path / "store"), recovery_buffer=window, max_depth=depth, sync=True, batch_delay_ms=50.0
        )
        async with _subscribed_beside_a_hog(config, "t") as (engine, turns):
            for index in range(depth):
                engine.route_publish("t", b"q%d" % index, 1)
            await engine.written_so_far()

            def overflow() -> None:  # the pump's second batch (16) waits for its turn
                for index in range(17):  # 16 drop that batch, the 17th the first of these (uncommitted)
                    engine.route_publish("t", b"n%d" % index, 1)

            turns.on_queue = overflow
            transport = PassTransport(turns, acks=False)
            await engine.attach("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= depth, LIMIT)
            assert turns.on_queue is None, "the second batch waited"
            expected = [b"q%d" % i for i in range(FIRST_RUN)] + [b"n%d" % i for i in range(1, 17)]
            assert [p.payload for p in sent] == expected
            _assert_every_batch_went_out_in_a_pass_granted_to_it(transport, turns)
            await engine.detach("c", transport)

    asyncio.run(main())


def _publishes(transport: RecordingTransport) -> list[Sent]:
    return [p for p in transport.packets if p.packet_type == 3]


async def _queued_on_t(engine: DurableEngine, count: int) -> None:
    """Session c subscribed to t, with q0, q1, ... (count of them) queued and written."""
    await engine.connect("c", clean_session=False)
    await engine.subscribe("c", "t", 1)
    for index in range(count):
        engine.route_publish("t", b"q%d" % index, 1)
    await engine.written_so_far()


def _acl_answering_after(act: Callable[[], None], acted: asyncio.Event) -> Callable[[str], Awaitable[bool]]:
    """An ACL plugin that answers in a later pass, and runs ``act`` before its answer until ``acted`` is set."""

    async def allowed(topic: str) -> bool:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        if not acted.is_set():
            loop.call_soon(act)
        loop.call_soon(answer.set_result, True)
        return bool(await answer)

    return allowed


async def _passes(count: int = 20) -> None:
    """Let every task that can run, run (a granted turn is written in the next pass)."""
    for _ in range(count):
        await asyncio.sleep(0)


@pytest.mark.parametrize("waits_for", ["turn", "acl"])
def test_a_hello_while_a_batch_waits_holds_it_until_ready(tmp_path: Path, waits_for: str) -> None:
    """docs/protocol.md: after hello nothing goes out until ready; then the queue, flagged replayed,
    then the marker. A hello that came while a batch read from the store waited for its turn (or
    the topic ACL's answer) let that batch out right after, before ready, framed but not flagged
    replayed. It goes back to the buffer instead, and out after ready with the flag."""
    window, queued = 100, 40

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window))
        engine.open()
        turns = engine.replay_turns = WatchedTurns(window)
        hog = asyncio.ensure_future(_hog(turns))
        helloed = asyncio.Event()
        transport = OrderedTransport("c", [])
        before_hello: list[int] = []

        def hello() -> None:
            before_hello.append(len(_publishes(transport)))
            engine.hello("c", None)
            helloed.set()

        allowed = _acl_answering_after(hello, helloed)  # the hello comes before its answer

        try:
            await _queued_on_t(engine, queued)
            read_access = None
            if waits_for == "turn":
                turns.on_queue = hello  # the second batch waits for its turn
            else:
                read_access = ReadAccess(allowed)  # the first batch waits for the ACL
            await engine.attach("c", transport, read_access)
            await asyncio.wait_for(helloed.wait(), LIMIT)
            await _passes()
            assert len(_publishes(transport)) == before_hello[0], "nothing goes out between hello and ready"
            assert engine.ready("c", transport)
            packets = await transport.wait_for(lambda ps: any(p.topic == MARKER_TOPIC for p in ps), LIMIT)
            sent = [p for p in packets if p.packet_type == 3]
            plain, framed = sent[: before_hello[0]], sent[before_hello[0] :]
            assert [p.topic for p in framed] == ["t"] * (queued - len(plain)) + [MARKER_TOPIC]
            frames = [decode_frame(p.payload) for p in framed[:-1]]
            assert [p.payload for p in plain] + [payload for _, payload in frames] == [
                b"q%d" % i for i in range(queued)
            ]
            assert all(frame.replayed for frame, _ in frames), "sent after ready, up to its point: replayed"
            assert decode_marker(framed[-1].payload).replayed == len(frames)
            await engine.detach("c", transport)
        finally:
            hog.cancel()
            await asyncio.gather(hog, return_exceptions=True)
            await engine.close()

    asyncio.run(main())


class GrantLog(ReplayTurns):
    """The real turns, counting the messages they granted turns for and, per turn granted as a
    session's first batch, how many writes its pump's transport (``transport``) had made before."""

    def __init__(self) -> None:
        super().__init__()
        self.granted = 0
        self.firsts: list[int] = []
        self.transport: RecordingTransport | None = None

    def try_take(self, size: int, first: bool, last: int | None = None) -> bool:
        took = super().try_take(size, first, last)
        if took:
            self._grant(size, first)
        return took

    async def take(self, size: int, first: bool, last: int | None = None) -> None:
        granted = self.granted
        await super().take(size, first, last)
        if self.granted == granted:  # not at once (try_take counted that): granted by a pass
            self._grant(size, first)

    def _grant(self, size: int, first: bool) -> None:
        self.granted += size
        if first:
            assert self.transport is not None
            self.firsts.append(self.transport.writes)


async def _falls_behind(tmp_path: Path) -> tuple[GrantLog, int]:
    """A session attached with an empty queue gets a burst of LIVE_BUFFER + 76 messages in one
    pass (window 10, a client that acknowledges each write in the next pass): the first
    LIVE_BUFFER are kept in memory (live), the rest read from the store after them. Returns the
    turns and how many messages were read from the store."""
    total, window = LIVE_BUFFER + 76, 10
    engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window))
    engine.open()
    turns = engine.replay_turns = GrantLog()
    try:
        await engine.connect("c", clean_session=False)
        await engine.subscribe("c", "t", 1)
        transport = turns.transport = OrderedTransport("c", [])
        await engine.attach("c", transport)
        for index in range(total):
            engine.route_publish("t", b"%d" % index, 1)
        await engine.written_so_far()
        sent = await transport.wait_for(lambda ps: len(ps) >= total, LIMIT)
        assert [p.payload for p in sent] == [b"%d" % i for i in range(total)], "in order, once"
        await engine.detach("c", transport)
    finally:
        await engine.close()
    return turns, total - LIVE_BUFFER


def test_messages_read_from_the_store_after_live_ones_take_turns(tmp_path: Path) -> None:
    """A batch that began with live messages (no turn) went on with those read from the store
    after them, up to a window of them without a turn: here the 4 live ones left and 6 read from
    the store. A batch is all live or all read from the store; the latter take turns for all."""

    async def main() -> None:
        turns, stored = await _falls_behind(tmp_path)
        assert turns.granted >= stored, f"turns for {turns.granted} of the {stored} messages read from the store"

    asyncio.run(main())


def test_a_session_that_falls_behind_after_live_messages_gets_no_first_batch_turn(tmp_path: Path) -> None:
    """Only the batch written at attach is a first batch (a turn at once, whatever others wait
    for). A pump whose first writes were live messages, and that then fell behind, sent its first
    batch read from the store as a "first" one again."""

    async def main() -> None:
        turns, _ = await _falls_behind(tmp_path)
        assert turns.firsts == [], f"first-batch turns after {turns.firsts} writes"

    asyncio.run(main())


def test_drop_oldest_takes_from_a_batch_waiting_for_the_topic_acl(tmp_path: Path) -> None:
    """docs/guarantees.md: drop-oldest deletes the oldest message not sent yet. A batch taken from
    the buffer that waited for the topic ACL was in neither the buffer nor in flight: a publish past
    max_depth then dropped a newer message (the first after the batch) instead of its oldest."""
    window, depth = 100, 24

    async def main() -> None:
        config = DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window, max_depth=depth)
        engine = DurableEngine(config)
        engine.open()
        published = asyncio.Event()

        def overflow() -> None:
            assert engine.route_publish("t", b"n", 1) is not None
            published.set()

        allowed = _acl_answering_after(overflow, published)  # a publish comes before its answer

        try:
            await _queued_on_t(engine, depth)
            transport = OrderedTransport("c", [])
            await engine.attach("c", transport, ReadAccess(allowed))
            sent = await transport.wait_for(lambda ps: len(ps) >= depth, LIMIT)
            assert published.is_set()
            assert [p.payload for p in sent] == [b"q%d" % i for i in range(1, depth)] + [b"n"], "q0 dropped"
            assert engine.sessions["c"].dropped == 1
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


def test_drop_oldest_takes_from_a_batch_waiting_for_its_sent_mark(tmp_path: Path) -> None:
    """As above, while the batch waits for the commit of its sent mark: the client acknowledged the
    first batch (window 4), and the pump's next batch needs a mark past the one attach stored (with
    sync: true the write of the acks, which carries the mark queued ahead, is still in a thread when
    the pump takes the batch: it commits a mark of its own). That commit is held until five
    publishes fill the queue again and pass max_depth by one: that must drop the waiting batch's
    oldest, not the first message after it."""
    window, depth, more = 4, 12, 5

    async def main() -> None:
        config = DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window, max_depth=depth, sync=True)
        engine = DurableEngine(config)
        engine.open()
        waiting, release = asyncio.Event(), asyncio.Event()
        try:
            await _queued_on_t(engine, depth)
            transport = RecordingTransport()
            await engine.attach("c", transport)
            session = engine.sessions["c"]
            real = session.advance_sent_mark

            async def held_mark(highest: int, window: int) -> None:  # the commit, once the test says
                waiting.set()
                await release.wait()
                await real(highest, window)

            session.advance_sent_mark = held_mark  # type: ignore[method-assign]
            total, acked = depth + more - 1, 0
            for _ in range(total):  # bounded: each round acknowledges at least one more
                sent = await transport.wait_for(lambda ps, seen=acked: len(ps) > seen, LIMIT)
                for packet in sent[acked:]:
                    assert packet.packet_id is not None
                    transport.ack("puback", packet.packet_id)
                if acked == 0:  # the pump wakes, takes its next batch and waits for its mark
                    await asyncio.wait_for(waiting.wait(), LIMIT)
                    for index in range(more):
                        assert engine.route_publish("t", b"n%d" % index, 1) is not None
                    session.advance_sent_mark = real  # type: ignore[method-assign]
                    release.set()
                acked = len(sent)
                if acked >= total:
                    break
            payloads = b",".join(p.payload for p in transport.packets).decode()
            expected = [f"q{i}" for i in range(depth) if i != window] + [f"n{i}" for i in range(more)]
            assert payloads == ",".join(expected), "q4 dropped"
            assert engine.sessions["c"].dropped == 1
            await engine.detach("c", transport)
        finally:
            release.set()
            await engine.close()

    asyncio.run(main())


def test_a_batch_a_hello_put_back_goes_out_after_ready_without_waiting_for_acks(tmp_path: Path) -> None:
    """A batch that fills the window (32, refilled by 8) marks the pump as refilling; put back by a
    hello while it waited for the topic ACL, the pump stayed marked: after ready it waited for 8
    acks before sending the 4 messages that fit the window. Put back, the pump is as before the take."""
    window, first, later = 32, 28, 10

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window))
        engine.open()
        asked, answer = asyncio.Event(), asyncio.Event()

        async def allowed(topic: str) -> bool:  # an ACL plugin that answers for t/b when the test says
            if topic == "t/b":
                asked.set()
                await answer.wait()
            return True

        try:
            await engine.connect("c", clean_session=False)
            await engine.subscribe("c", "t/#", 1)
            transport = RecordingTransport()  # a client that acknowledges nothing
            await engine.attach("c", transport, ReadAccess(allowed))
            for index in range(first):
                engine.route_publish("t/a", b"a%d" % index, 1)
            await transport.wait_for(lambda ps: len(ps) >= first, LIMIT)
            for index in range(later):
                engine.route_publish("t/b", b"b%d" % index, 1)
            await asyncio.wait_for(asked.wait(), LIMIT)  # a batch of 4 (the window is full after it) waits
            engine.hello("c", None)
            answer.set()
            await _passes()
            assert len(_publishes(transport)) == first, "nothing goes out between hello and ready"
            assert engine.ready("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= window, LIMIT)
            frames = [decode_frame(p.payload) for p in sent[first:]]
            assert [payload for _, payload in frames] == [b"b%d" % i for i in range(window - first)]
            assert all(frame.replayed for frame, _ in frames)
            await engine.detach("c", transport)
        finally:
            answer.set()
            await engine.close()

    asyncio.run(main())


def test_drop_oldest_takes_from_a_batch_the_topic_acl_failed_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL plugin that raises stops the pump (an internal error; the client's next connection
    starts another). The batch it raised on was lost from the buffer: until then drop-oldest could
    not see it and dropped the first message after it. It is put back, so its oldest is dropped."""
    window, depth = 100, 24

    async def main() -> None:
        config = DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window, max_depth=depth)
        engine = DurableEngine(config)
        engine.open()
        raised = asyncio.Event()

        async def failing(topic: str) -> bool:  # an ACL plugin that fails once
            if not raised.is_set():
                raised.set()
                raise RuntimeError("ACL backend down")
            return True

        try:
            await _queued_on_t(engine, depth)
            transport = RecordingTransport()
            with caplog.at_level(logging.ERROR, logger="amqtt_durable.delivery"):
                await engine.attach("c", transport, ReadAccess(failing))
                await asyncio.wait_for(raised.wait(), LIMIT)
                await _passes()
            assert "stopped by an internal error" in caplog.text
            assert _publishes(transport) == []
            assert engine.route_publish("t", b"n", 1) is not None
            assert engine.sessions["c"].dropped == 1
            await engine.detach("c", transport)
            await engine.connect("c", clean_session=False)
            again = OrderedTransport("c", [])
            await engine.attach("c", again)
            sent = await again.wait_for(lambda ps: len(ps) >= depth, LIMIT)
            assert [p.payload for p in sent] == [b"q%d" % i for i in range(1, depth)] + [b"n"], "q0 dropped"
            await engine.detach("c", again)
        finally:
            await engine.close()

    asyncio.run(main())
