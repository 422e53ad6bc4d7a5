"""RetainedAcks: a clean connection's QoS 1/2 messages awaiting their acks, as table entries. On
amqtt's own loop a wait ends unacknowledged at its timeout; once ``never_expire`` (the plugin's
reader) only with its ack or the end; a PUBREC's wait moves to its PUBCOMP; the message loop's room
(``room``) counts retained waits only, closes at ``most`` of them while the reader reads, opens at
half or when it pauses; the connection's end hands back every wait and nothing is awaited after.
PacketIds: free packet ids in O(1), none amqtt holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from test_subscription_changes import BOUND, run

from amqtt_durable.delivery import AckKind
from amqtt_durable.retained_acks import PacketIds, RetainedAcks

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


def test_packet_ids_are_given_in_o1_skip_those_amqtt_holds_and_come_back_once_given_back() -> None:
    ids = PacketIds(most=5)
    held = {2}  # amqtt's inflight_in / inflight_out
    assert [ids.take(held) for _ in range(4)] == [1, 3, 4, 5]
    assert ids.take(held) is None  # 2 still held: none free
    held.clear()
    assert ids.take(held) == 2  # skipped, not lost
    assert ids.take(held) is None
    ids.give_back(4)
    ids.give_back(1)
    assert ids.take({4}) == 1  # 4 held meanwhile: looked at once, kept for later
    assert ids.take() == 4
    assert ids.take() is None


def test_a_near_full_table_of_packet_ids_takes_no_scan() -> None:
    """amqtt's ``next_packet_id`` scanned up to all 65,535 ids per message (18.6 ms near a full
    table); here a take and a give-back cost the same whatever is held."""
    ids = PacketIds()
    for _ in range(65534):
        assert ids.take() is not None
    last = ids.take()
    assert last is not None and ids.take() is None
    started = time.perf_counter()
    for _ in range(10_000):
        ids.give_back(last)
        assert ids.take() == last
        assert ids.take() is None
    assert time.perf_counter() - started < 1.0  # a scan each: over 100 s


def test_a_wait_never_ends_but_with_its_ack_or_the_end_once_never_expire() -> None:
    """On the plugin's reader (``never_expire``, set after waits began: live messages go from the
    CONNACK on) no wait is given up: MQTT 3.1.1 has no ack timeout."""

    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT)
        assert acks.expires
        assert acks.send("puback", False, None) == 1
        acks.never_expire()
        assert not acks.expires
        assert acks.send("pubrec", True, None) == 2
        assert not await expired.next(20 * TIMEOUT), expired.waits
        assert len(acks) == 2
        acks.done(1)
        assert acks.stop() == [(2, "pubrec")]

    run(main)


def test_on_amqtts_loop_a_wait_ends_at_its_timeout_and_a_pubcomp_wait_gets_its_own_deadline() -> None:
    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT)
        assert acks.send("puback", True, None) == 1
        assert acks.send("pubrec", False, None) == 2
        assert acks.send("puback", False, None) == 3
        acks.done(1)
        assert acks.awaits(2, "pubrec") and not acks.awaits(2, "pubcomp")
        assert acks.wait(2, "pubcomp")  # its PUBREC came: the PUBCOMP is awaited from now
        assert acks.awaits(2, "pubcomp")
        assert not acks.wait(1, "puback")  # acknowledged: nothing awaited
        while len(expired.waits) < 2:  # bounded by BOUND
            assert await expired.next(BOUND)
        assert expired.waits == [(3, "puback"), (2, "pubcomp")]
        assert len(acks) == 0
        assert [acks.send("puback", False, None) for _ in range(3)] == [4, 5, 6]  # then 1, 3, 2 again

    run(main)


def test_room_counts_retained_waits_only_closes_at_most_and_opens_at_half_or_a_pause() -> None:
    """Live waits (bounded by max_pending_clean) do not count: 2,500 of them held a clean client's
    next SUBACK for ever once the room had closed (it opened at 2,048 waits of any kind)."""

    async def main() -> None:
        acks = RetainedAcks(Expired(), timeout=BOUND, most=4)
        acks.never_expire()

        async def room_within(seconds: float) -> bool:
            return await within(acks.room(), seconds)

        live = [acks.send("puback", False, None) for _ in range(10)]
        assert None not in live
        assert await room_within(0)
        retained = []
        for _ in range(4):
            assert await room_within(0)
            retained.append(acks.send("puback", True, None))
        assert not await room_within(0.01)
        acks.reader_paused(True)  # the acks sit behind the paused read: the loop goes on
        assert await room_within(0)
        acks.reader_paused(False)
        assert not await room_within(0.01)
        acks.done(retained[0])
        assert not await room_within(0.01)  # 3 retained wait: more than half
        acks.done(retained[1])
        assert await room_within(0)  # 10 live ones still wait
        assert len(acks) == 12

    run(main)


def test_once_the_connections_end_began_the_room_stays_open() -> None:
    """``ending`` (a DISCONNECT, a take-over, ``stop()``, the reader's EOF): no ack comes any more,
    so neither a later ``reader_paused(False)`` (the reader's pause ending) nor more retained waits
    close the room again (when they did, the end waited connection_end_wait for the SUBSCRIBEs the
    loop could not apply and dropped them unanswered)."""

    async def main() -> None:
        acks = RetainedAcks(Expired(), timeout=BOUND, most=2)
        acks.never_expire()
        for _ in range(2):
            assert acks.send("puback", True, None) is not None
        assert not await within(acks.room(), 0.01)
        acks.reader_paused(True)
        acks.ending()
        acks.reader_paused(False)
        assert await within(acks.room(), 0)
        assert acks.send("puback", True, None) is not None
        assert await within(acks.room(), 0)
        assert len(acks) == 3

    run(main)


def test_no_id_free_sends_nothing_and_stop_hands_back_every_wait_and_nothing_is_awaited_after() -> None:
    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=TIMEOUT, most=1, ids=PacketIds(most=2))
        assert acks.send("puback", True, None) == 1
        assert acks.send("pubrec", False, None) == 2
        assert acks.send("puback", False, None) is None  # no id free
        assert len(acks) == 2
        assert acks.wait(2, "pubcomp")
        assert acks.stop() == [(1, "puback"), (2, "pubcomp")]
        assert acks.send("puback", False, None) is None
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
            assert acks.send("pubrec", False, lambda packet_id=packet_id: finished.append(packet_id)) == packet_id
        assert acks.wait(1, "pubcomp")  # its PUBREC came
        acks.done(1)
        assert finished == [1]
        assert await expired.next(BOUND)
        assert finished == [1, 2, 3] and expired.waits == [(2, "pubrec"), (3, "pubrec")]
        acks.done(2)  # the glue's own done after the expiry: not called again
        assert acks.send("puback", False, lambda: finished.append(4)) is not None
        acks.stop()
        assert finished == [1, 2, 3, 4]

    run(main)


def test_waiting_again_for_the_same_ack_restarts_its_time() -> None:
    """On amqtt's loop the glue waits again once the write is done: the 5 s run from then, not
    from before the wait for the write lock and the drain."""

    async def main() -> None:
        expired = Expired()
        acks = RetainedAcks(expired, timeout=4 * TIMEOUT)
        loop = asyncio.get_running_loop()
        assert acks.send("puback", True, None) == 1
        await asyncio.sleep(3 * TIMEOUT)  # the write's drain, as a test's stand-in
        restarted = loop.time()
        assert acks.wait(1, "puback")
        assert await expired.next(BOUND)
        assert loop.time() - restarted >= 4 * TIMEOUT * 0.99, loop.time() - restarted

    run(main)
