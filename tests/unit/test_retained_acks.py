"""RetainedAcks: a clean connection's retained messages awaiting their acks, as table entries. A
wait ends unacknowledged only once its timeout passed and the reader has read all its client sent
(``caught_up``); a PUBREC's wait moves to its PUBCOMP with a new deadline; the message loop's room
(``room``) closes at ``most`` waits while the reader reads, opens at half or when it pauses; the
connection's end hands back every wait and nothing is awaited after."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from test_subscription_changes import BOUND, run

from amqtt_durable.delivery import AckKind
from amqtt_durable.retained_acks import RetainedAcks

TIMEOUT = 0.05
"""The ack timeout of these tests (amqtt's is 5 s)."""


async def within(waited: Coroutine[Any, Any, Any], seconds: float) -> bool:
    """Whether ``waited`` ends within ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            await waited
    except TimeoutError:
        return False
    return True


class Expired:
    """The waits ``RetainedAcks`` gave up, and an event per new one."""

    def __init__(self) -> None:
        self.waits: list[tuple[int, AckKind]] = []
        self.event = asyncio.Event()

    def __call__(self, packet_id: int, kind: AckKind) -> None:
        self.waits.append((packet_id, kind))
        self.event.set()

    async def next(self, seconds: float) -> bool:
        self.event.clear()
        return await within(self.event.wait(), seconds)


def test_a_wait_ends_at_its_timeout_only_once_the_reader_has_caught_up() -> None:
    """An ack the reader has not read may be among what it has not read: the wait ends at its
    timeout only if the reader has caught up, else once it has (looked at every ``recheck``)."""

    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT, recheck=TIMEOUT / 5)
        behind = [True]
        acks.caught_up = lambda: not behind[0]
        assert acks.wait(1, "puback")
        assert acks.wait(2, "pubrec")
        assert not await expired.next(20 * TIMEOUT), expired.waits  # behind: not given up
        assert len(acks) == 2
        behind[0] = False
        assert await expired.next(BOUND)
        assert expired.waits == [(1, "puback"), (2, "pubrec")]
        assert len(acks) == 0

    run(main)


def test_an_acknowledged_wait_does_not_end_and_a_pubcomp_wait_gets_its_own_deadline() -> None:
    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT)
        assert acks.wait(1, "puback")
        assert acks.wait(2, "pubrec")
        assert acks.wait(3, "puback")
        acks.done(1)
        assert acks.awaits(2, "pubrec") and not acks.awaits(2, "pubcomp")
        assert acks.wait(2, "pubcomp")  # its PUBREC came: the PUBCOMP is awaited from now
        assert acks.awaits(2, "pubcomp")
        while len(expired.waits) < 2:  # bounded by BOUND
            assert await expired.next(BOUND)
        assert expired.waits == [(3, "puback"), (2, "pubcomp")]

    run(main)


def test_room_closes_at_most_waits_while_the_reader_reads_and_opens_at_half_or_a_pause() -> None:
    async def main() -> None:
        acks = RetainedAcks(Expired(), timeout=BOUND, most=4)

        async def room_within(seconds: float) -> bool:
            return await within(acks.room(), seconds)

        for packet_id in range(1, 5):
            assert await room_within(0)
            acks.wait(packet_id, "puback")
        assert not await room_within(0.01)
        acks.reader_paused(True)  # the acks sit behind the paused read: the loop goes on
        assert await room_within(0)
        acks.reader_paused(False)
        assert not await room_within(0.01)
        acks.done(1)
        assert not await room_within(0.01)  # 3 wait: more than half
        acks.done(2)
        assert await room_within(0)

    run(main)


def test_stop_hands_back_every_wait_and_nothing_is_awaited_after() -> None:
    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT, most=1)
        acks.wait(7, "puback")
        acks.wait(8, "pubcomp")
        assert acks.stop() == [(7, "puback"), (8, "pubcomp")]
        assert not acks.wait(9, "puback")
        assert len(acks) == 0
        await acks.room()
        assert not await expired.next(4 * TIMEOUT)  # the timer went with them

    run(main)


def test_a_waits_finished_is_called_once_however_it_ends() -> None:
    """A live message counts in ``max_pending_clean`` until its wait ends: ``finished`` is called
    once, at its last ack (a PUBREC's wait moved to its PUBCOMP keeps it), its expiry, or the end."""

    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT)
        finished: list[int] = []
        for packet_id in (1, 2, 3):
            assert acks.wait(packet_id, "pubrec", lambda packet_id=packet_id: finished.append(packet_id))
        assert acks.wait(1, "pubcomp")  # its PUBREC came
        acks.done(1)
        assert finished == [1]
        assert await expired.next(BOUND)
        assert finished == [1, 2, 3] and expired.waits == [(2, "pubrec"), (3, "pubrec")]
        acks.done(2)  # the glue's own done after the expiry: not called again
        assert acks.wait(4, "puback", lambda: finished.append(4))
        acks.stop()
        assert finished == [1, 2, 3, 4]

    run(main)


def test_waiting_again_for_the_same_ack_restarts_its_time() -> None:
    """The glue waits again once the write is done: the 5 s run from then, not from before the
    wait for the write lock and the drain."""

    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=4 * TIMEOUT)
        loop = asyncio.get_running_loop()
        assert acks.wait(1, "puback")
        await asyncio.sleep(3 * TIMEOUT)  # the write's drain, as a test's stand-in
        restarted = loop.time()
        assert acks.wait(1, "puback")
        assert await expired.next(BOUND)
        assert loop.time() - restarted >= 4 * TIMEOUT * 0.99, loop.time() - restarted

    run(main)
