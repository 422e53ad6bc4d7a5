"""RetainedAcks: a clean connection's QoS 1/2 messages awaiting their acks, as table entries. On
amqtt's own loop a wait ends unacknowledged at its timeout; once ``never_expire`` (the plugin's
reader) only with its ack or the end; a PUBREC's wait moves to its PUBCOMP; the message loop's room
(``room``) counts retained waits only, closes at ``most`` of them while the reader reads, opens at
half or when it pauses, and for good once the connection's end began; the connection's end hands
back every wait and nothing is awaited after.
PacketIds: free packet ids, none amqtt holds, a take looking at one id (an id amqtt holds is
looked at once per hold, not at every take)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from test_subscription_changes import BOUND, run

from amqtt_durable.delivery import AckKind
from amqtt_durable.retained_acks import HELD_LOOKS, MAX_PACKET_ID, REUSE_AFTER, PacketIds, RetainedAcks

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


class Held(set[int]):
    """Ids amqtt holds (the session's ``inflight_out``), counting the ids ``PacketIds`` looks at."""

    looked = 0

    def __contains__(self, packet_id: object) -> bool:
        self.looked += 1
        return super().__contains__(packet_id)

    def take(self, ids: PacketIds) -> tuple[int | None, int]:
        """The id ``ids`` takes and how many it looked at for it."""
        before = self.looked
        return ids.take(self), self.looked - before


def test_packet_ids_skip_those_amqtt_holds_and_come_back_once_given_back() -> None:
    ids = PacketIds(most=5)
    held = {2}  # amqtt's inflight_out
    assert [ids.take(held) for _ in range(4)] == [1, 3, 4, 5]
    assert ids.take(held) is None  # 2 still held: none free
    held.clear()
    assert ids.take(held) == 2  # set aside, not lost
    assert ids.take(held) is None
    ids.give_back(4)
    ids.give_back(1)
    assert ids.take({4}) == 1  # 4 held meanwhile: set aside for later
    assert ids.take() == 4
    assert ids.take() is None


def test_the_id_of_a_wait_given_up_is_taken_only_once_no_other_is_free() -> None:
    """On amqtt's own loop a wait is given up 5 s after its write and its ack may still come: its id
    must not meet a newer message while another is free (review 334: with acknowledged ones it came
    back after 32 takes, or at once)."""
    ids = PacketIds(most=40)
    taken = [ids.take() for _ in range(REUSE_AFTER + 2)]
    ids.give_back(1, given_up=True)
    for packet_id in taken[1:]:
        assert packet_id is not None
        ids.give_back(packet_id)
    while (packet_id := ids.take()) not in (None, 1):  # bounded: 40 ids
        pass
    assert packet_id == 1 and ids.take() is None


def test_a_long_lived_connection_keeps_few_ids_given_back_and_reuses_none_at_once() -> None:
    """A connection that sends 200,000 messages, each acked before the next, keeps using the first
    REUSE_AFTER ids (when ids never given went first, all 65,535 ended in the FIFO: some 2.4 MB for
    each long-lived connection), and an id given back goes behind REUSE_AFTER - 1 others."""
    ids = PacketIds()
    last_taken: dict[int, int] = {}
    for turn in range(200_000):
        packet_id = ids.take()
        assert packet_id is not None and packet_id <= REUSE_AFTER, (turn, packet_id)
        assert turn - last_taken.get(packet_id, -REUSE_AFTER) >= REUSE_AFTER, (turn, packet_id)
        last_taken[packet_id] = turn
        ids.give_back(packet_id)


def test_a_take_looks_at_one_id_whatever_is_held() -> None:
    """amqtt's ``next_packet_id`` looked through up to all 65,535 ids per message (18.6 ms near a
    full table). Here a take looks at one id while up to all 65,535 are held by the connection's
    own waits (in ``inflight_out`` until their acks), and at none when none is free."""
    ids = PacketIds()
    held = Held()
    for _ in range(MAX_PACKET_ID):
        packet_id, looked = held.take(ids)
        assert packet_id is not None and looked == 1
        held.add(packet_id)
    assert held.take(ids) == (None, 0)
    for packet_id in range(1, 1_001):  # an ack frees one, the next message takes it
        held.discard(packet_id)
        ids.give_back(packet_id)
        assert held.take(ids) == (packet_id, 1)
        held.add(packet_id)


def test_ids_amqtt_holds_are_looked_at_once_not_at_every_take() -> None:
    """60,000 ids given back are then held by amqtt: the take that meets them sets them aside once
    (when they went back to the FIFO, every take looked through all of them again: 8.35 ms each);
    the takes after look at one id each, and, once none is free, at most HELD_LOOKS set aside."""
    ids = PacketIds()
    for _ in range(MAX_PACKET_ID):
        assert ids.take() is not None
    for packet_id in range(1, MAX_PACKET_ID + 1):
        ids.give_back(packet_id)
    held = Held(range(1, 60_001))
    assert held.take(ids) == (60_001, 60_001)
    for packet_id in range(60_002, MAX_PACKET_ID + 1):
        assert held.take(ids) == (packet_id, 1)
    for packet_id in range(60_001, 61_001):  # an ack frees one, the next message takes it
        ids.give_back(packet_id)
        assert held.take(ids) == (packet_id, 1)
    assert held.take(ids) == (None, HELD_LOOKS)  # looked at 1 to 8 again
    held.discard(HELD_LOOKS + 3)  # amqtt freed one: a later take finds it
    assert held.take(ids) == (HELD_LOOKS + 3, 3)
    assert held.take(ids) == (None, HELD_LOOKS)


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
