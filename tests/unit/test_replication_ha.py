"""The HA decisions (ha.HaNode), with the coordinator faked at its interface and a fake clock."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import replace

import pytest

from amqtt_durable.replication.coordinator import Coordinator, Leader, Member, record_field
from amqtt_durable.replication.errors import CoordinatorError, MemberNameTakenError
from amqtt_durable.replication.ha import Decision, HaNode, ahead_of
from amqtt_durable.replication.tool import format_status

TTL = 10.0
MARGIN = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeCoordinator(Coordinator):
    """One leader key under a lease that expires ``ttl`` after its last renewal, on ``clock``;
    the members' records expire the same way (shared by the nodes of one test, keyed by name)."""

    def __init__(self, clock: Clock, ttl: float = TTL) -> None:
        self.clock = clock
        self.ttl = ttl
        self.holder: Leader | None = None
        self.expires = 0.0
        self.initialized_by: str | None = None
        self.sync: frozenset[str] | None = None
        self.sync_leader: str | None = None
        self.last_primary: str | None = None
        self.last_term = self.sync_term = 0
        """The terms of ``last_primary`` and ``sync_leader`` (0: unknown, as a test set them)."""
        self.terms = 0
        """As etcd's revisions: each acquire gives a larger term."""
        self.down = False
        self.hang: asyncio.Event | None = None
        self.records: dict[str, tuple[Member, float]] = {}

    async def _reach(self) -> None:
        if self.hang is not None:
            await self.hang.wait()
        if self.down:
            raise CoordinatorError("fake", "connection refused")
        if self.holder is not None and self.clock() >= self.expires:
            self.holder = None

    async def leader(self) -> Leader | None:
        await self._reach()
        return self.holder

    async def acquire(self, me: Leader) -> bool:
        await self._reach()
        if self.holder is not None:
            return False
        self.terms += 1
        self.holder, self.expires = Leader(me.name, me.address, self.terms), self.clock() + self.ttl
        self.last_primary, self.last_term = me.name, self.terms
        return True

    async def renew(self, me: Leader) -> bool:
        await self._reach()
        if self.holder != me:
            return False
        self.expires = self.clock() + self.ttl
        return True

    async def release(self, me: Leader) -> None:
        await self._reach()
        if self.holder == me:
            self.holder = None

    async def publish_sync(self, me: Leader, members: frozenset[str] | None) -> bool:
        await self._reach()
        if self.holder != me:
            return False
        self.sync, self.sync_leader = members, None if members is None else me.name
        self.sync_term = self.holder.term
        return True

    async def sync_members(self) -> frozenset[str] | None:
        await self._reach()
        return self.sync

    async def former_primaries(self) -> frozenset[tuple[str, int]]:
        await self._reach()
        recorded = ((self.last_primary, self.last_term), (self.sync_leader, self.sync_term))
        return frozenset((name, term) for name, term in recorded if name is not None)

    async def publish_member(self, member: Member) -> None:
        """As etcd's: a live record under the name at another address is another broker's."""
        await self._reach()
        held = self.records.get(member.name)
        if held is not None and self.clock() < held[1] and held[0].address not in ("", member.address):
            raise MemberNameTakenError(held[0])
        self.records[member.name] = (member, self.clock() + self.ttl)

    async def members(self) -> list[Member]:
        await self._reach()
        return [member for member, expires in self.records.values() if self.clock() < expires]

    async def withdraw_member(self) -> None:
        await self._reach()  # one coordinator object per test, shared: nothing to withdraw by name

    async def initialize(self, name: str) -> bool:
        await self._reach()
        if self.initialized_by is None:
            self.initialized_by = name
            return True
        return False


class Hooks:
    def __init__(self, *, caught_up: bool = True, seq: int = 0, store_id: int = 7, whole: bool = True) -> None:
        self.is_caught_up = caught_up
        self.whole = whole
        self.seq = seq
        self.store_id = store_id
        self.fail_promotion = False
        self.followed: list[Leader] = []
        self.promoted = 0
        self.demoted: list[str] = []
        self.demoted_event = asyncio.Event()

    def caught_up(self) -> bool:
        return self.is_caught_up

    def position(self) -> tuple[int, int]:
        return self.store_id, self.seq

    def store_whole(self) -> bool:
        return self.whole

    def follow(self, leader: Leader) -> None:
        """As ReplicationNode.follow: another leader, or the same in another term, decides anew
        (a test sets ``is_caught_up`` again where its IN_SYNC came); ``caught_up`` as the hooks
        were made stands for the first one's."""
        last = self.followed[-1] if self.followed else None
        if last is not None and (last, last.term) != (leader, leader.term):
            self.is_caught_up = False
        self.followed.append(leader)

    async def promote(self) -> None:
        if self.fail_promotion:
            raise RuntimeError("the store would not load")
        self.promoted += 1

    def demote(self, reason: str) -> None:
        self.demoted.append(reason)
        self.demoted_event.set()


def node(coordinator: FakeCoordinator, hooks: Hooks, name: str = "a", clock: Clock | None = None) -> HaNode:
    return HaNode(
        coordinator,
        hooks,
        name=name,
        address=f"{name}:7000",
        loop_wait=1.0,
        demote_margin=MARGIN,
        clock=clock or coordinator.clock,
    )


async def a_primary() -> tuple[Clock, FakeCoordinator, Hooks, HaNode]:
    """Node "a" after its first cycle: primary of a new cluster, on a fake clock."""
    clock = Clock()
    fake = FakeCoordinator(clock)
    hooks = Hooks()
    ha = node(fake, hooks)
    await ha.run_cycle()
    assert ha.role == "primary"
    fake.initialized_by = fake.initialized_by or "a"  # as a real cluster's first node claims it
    return clock, fake, hooks, ha


def run(coro: object) -> object:
    async def main() -> object:
        return await asyncio.wait_for(coro, 10)  # type: ignore[arg-type]

    return asyncio.run(main())


def caught_up_backup(fake: FakeCoordinator) -> tuple[Hooks, HaNode]:
    """Node "a", caught up, in a cluster another node bootstrapped; nobody holds the lease."""
    fake.initialized_by = "old"
    hooks = Hooks(caught_up=True)
    return hooks, node(fake, hooks)


def test_a_caught_up_backup_takes_a_free_lease() -> None:
    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        hooks, ha = caught_up_backup(fake)
        decision = await ha.run_cycle()
        assert decision.action == "promoted"
        assert "caught up" in decision.reason
        assert (ha.role, hooks.promoted, fake.holder) == ("primary", 1, Leader("a", "a:7000"))
        assert ha.may_acknowledge()
        assert ha.deadline() == clock.now + TTL - MARGIN

    run(main())


def test_a_backup_that_is_not_caught_up_never_takes_the_lease() -> None:
    async def main() -> None:
        fake = FakeCoordinator(Clock())
        fake.initialized_by = "old"
        hooks = Hooks(caught_up=False)
        ha = node(fake, hooks)
        decision = await ha.run_cycle()
        assert decision.action == "wait"
        assert "not caught up" in decision.reason
        assert fake.holder is None
        assert not ha.may_acknowledge()

    run(main())


def test_the_first_node_of_a_new_cluster_bootstraps_it_once() -> None:
    async def main() -> None:
        fake = FakeCoordinator(Clock())
        first, second = node(fake, Hooks(caught_up=False), "a"), node(fake, Hooks(caught_up=False), "b")
        assert (await first.run_cycle()).action == "bootstrapped"
        decision = await second.run_cycle()
        assert decision.action == "follow"
        assert second.hooks.followed == [Leader("a", "a:7000")]  # type: ignore[attr-defined]

    run(main())


def test_a_backup_follows_the_leader_and_waits_for_its_own_stale_key() -> None:
    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        fake.holder, fake.expires = Leader("a", "a:7000"), clock.now + TTL
        restarted = node(fake, Hooks())
        decision = await restarted.run_cycle()
        assert decision.action == "wait"
        assert "before it restarted" in decision.reason
        other = node(fake, Hooks(), "b")
        assert (await other.run_cycle()).reason == "following primary a at a:7000"
        fake.holder = Leader("a", "elsewhere:7000")  # another broker with the same name
        clash = await restarted.run_cycle()
        assert (clash.action, clash.level) == ("wait", logging.ERROR)
        assert "another broker holds the leader lease under this node's name, a, at elsewhere:7000" in clash.reason

    run(main())


def test_a_primary_that_renews_stays_primary_and_its_deadline_moves() -> None:
    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        ha = node(fake, Hooks())
        await ha.run_cycle()
        clock.now += 5
        decision = await ha.run_cycle()
        assert decision.action == "renewed"
        assert ha.deadline() == clock.now + TTL - MARGIN

    run(main())


def test_a_primary_that_cannot_renew_retries_then_demotes_before_the_ttl_ends() -> None:
    async def main() -> None:
        clock, fake, hooks, ha = await a_primary()
        granted = clock.now
        fake.down = True
        clock.now += 3
        decision = await ha.run_cycle()
        assert decision.action == "retry"
        assert "still primary" in decision.reason
        assert ha.may_acknowledge()
        clock.now = granted + TTL - MARGIN  # the deadline: the lease is still ours for MARGIN seconds
        assert not ha.may_acknowledge()
        decision = await ha.run_cycle()
        assert decision.action == "demoted"
        assert ha.role == "backup"
        assert hooks.demoted and "no longer acknowledging" in hooks.demoted[0]
        fake.down = False
        assert fake.holder is not None  # nobody else could have taken it yet: demoted first

    run(main())


def test_a_primary_whose_lease_is_gone_demotes_at_once() -> None:
    async def main() -> None:
        _, fake, _, ha = await a_primary()
        fake.holder = Leader("b", "b:7000")  # e.g. an operator's manual failover
        decision = await ha.run_cycle()
        assert decision.action == "demoted"
        assert "lease is gone" in decision.reason
        assert not ha.may_acknowledge()

    run(main())


async def primary_on_the_loop_clock() -> tuple[FakeCoordinator, Hooks, HaNode]:
    """A primary on real (loop) time with a short lease, so its deadline timer really fires."""
    fake = FakeCoordinator(Clock(), ttl=0.6)
    hooks = Hooks()
    ha = HaNode(fake, hooks, name="a", address="a:1", loop_wait=0.1, demote_margin=0.3)
    ha.clock = asyncio.get_running_loop().time
    fake.clock = ha.clock  # type: ignore[assignment]
    assert ha.role == "backup"
    await ha.run_cycle()
    assert ha.role == "primary"
    return fake, hooks, ha


def test_a_hung_coordinator_cannot_keep_a_primary_acknowledging() -> None:
    async def main() -> None:
        fake, hooks, ha = await primary_on_the_loop_clock()
        fake.hang = asyncio.Event()
        cycle = asyncio.create_task(ha.run_cycle())  # never answered by the coordinator
        await asyncio.wait_for(hooks.demoted_event.wait(), 5)
        assert not ha.may_acknowledge()
        assert (await asyncio.wait_for(cycle, 5)).action == "demoted"
        assert len(hooks.demoted) == 1, "the timer demoted it; the renewal that timed out after must not again"
        assert ha.role == "backup" and ha._deadline is None

    run(main())


def test_the_deadline_timer_demotes_without_a_cycle() -> None:
    async def main() -> None:
        _, hooks, ha = await primary_on_the_loop_clock()
        await asyncio.wait_for(hooks.demoted_event.wait(), 5)  # no further cycle ran
        assert ha.role == "backup"
        assert ha.last is not None and "not renewed in time" in ha.last.reason

    run(main())


def test_an_unreachable_coordinator_keeps_a_backup_a_backup() -> None:
    async def main() -> None:
        fake = FakeCoordinator(Clock())
        fake.down = True
        decision = await node(fake, Hooks()).run_cycle()
        assert decision.action == "wait"
        assert "does not answer" in decision.reason

    run(main())


def test_the_lease_passes_only_after_the_old_primary_stopped_acknowledging() -> None:
    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        fake.initialized_by = "x"
        a, b = node(fake, Hooks(), "a"), node(fake, Hooks(), "b")
        await a.run_cycle()
        assert (await b.run_cycle()).action == "follow"
        granted = clock.now
        # a is cut off from etcd (it runs no cycle); b cycles, a's publishers keep asking a
        while b.role != "primary":
            clock.now += 0.25
            if a.may_acknowledge():
                assert fake.holder == a.me
            await b.run_cycle()
        assert clock.now >= granted + TTL
        assert not a.may_acknowledge()

    run(main())


@pytest.mark.parametrize("margin", [0.0, TTL])
def test_the_margin_must_lie_inside_the_ttl(margin: float) -> None:
    with pytest.raises(ValueError, match="demote_margin"):
        HaNode(FakeCoordinator(Clock()), Hooks(), name="a", address="a", loop_wait=1, demote_margin=margin)


def test_in_sync_mode_only_a_member_of_the_published_set_takes_over() -> None:
    async def main() -> None:
        clock, fake, _, a = await a_primary()
        assert await fake.publish_sync(a.me, frozenset({"c"}))
        b, c = node(fake, Hooks(), "b"), node(fake, Hooks(), "c")
        assert not await fake.publish_sync(b.me, frozenset({"b"}))  # only the leader writes it
        assert [(await n.run_cycle()).action for n in (b, c)] == ["follow", "follow"]  # caught up with a
        clock.now += TTL + 1  # a is gone, its lease expired
        decision = await b.run_cycle()
        assert decision.action == "wait"
        assert "not in the synchronous set" in decision.reason
        assert (await c.run_cycle()).action == "promoted"

    run(main())


# --- the members' positions: the most advanced backup takes over ------------------------------


def member(name: str, seq: int, *, store_id: int = 7, role: str = "backup", candidate: bool = True) -> Member:
    """The record ``name`` publishes (its replication address as three_nodes gives it)."""
    return Member(name, role, store_id, seq, candidate, f"{name}:7000")


def test_only_live_candidates_of_the_same_store_strictly_ahead_hold_a_backup_back() -> None:
    me = member("c", 60)
    others = [
        member("c", 90),  # this node's own (stale) record
        member("tie", 60),
        member("behind", 10),
        member("other-store", 500, store_id=8),
        member("not-caught-up", 500, candidate=False),
        member("old-primary", 500, role="primary", candidate=False),
    ]
    assert ahead_of(me, others) == []
    assert ahead_of(me, [*others, member("b", 61)]) == [member("b", 61)]
    # sync mode on top: a member outside the published set is never promoted, so it holds nobody back
    assert ahead_of(me, [member("b", 61)], frozenset({"c"})) == []
    assert ahead_of(me, [member("b", 61)], frozenset({"b", "c"})) == [member("b", 61)]


async def three_nodes(b_seq: int, c_seq: int) -> tuple[Clock, FakeCoordinator, HaNode, HaNode, HaNode]:
    """a primary; b and c caught-up backups at the given batches, each cycled once (published)."""
    clock, fake, _, a = await a_primary()
    b, c = node(fake, Hooks(seq=b_seq), "b"), node(fake, Hooks(seq=c_seq), "c")
    assert (await b.run_cycle()).action == "follow"
    assert (await c.run_cycle()).action == "follow"
    return clock, fake, a, b, c


def test_the_most_advanced_backup_takes_over_whichever_cycles_first() -> None:
    async def main() -> None:
        clock, fake, _, b, c = await three_nodes(b_seq=1900, c_seq=1200)
        clock.now += TTL + 1  # a is gone, its lease and its record expired
        await fake.publish_member(b.record())  # b's record is fresh again (as a live node's is every cycle) ...
        decision = await c.run_cycle()  # ... but c's cycle comes before b's takes the lease
        assert decision.action == "wait"
        assert (
            decision.reason
            == "no primary, but b is further ahead (batch 1900, this node 1200): leaving the lease to it"
        )
        assert fake.holder is None and c.hooks.promoted == 0  # type: ignore[attr-defined]
        assert (await b.run_cycle()).action == "promoted"
        assert (await c.run_cycle()).reason == "following primary b at b:7000"

    run(main())


def test_equal_positions_let_either_take_over() -> None:
    async def main() -> None:
        clock, _, _, _, c = await three_nodes(b_seq=1500, c_seq=1500)
        clock.now += TTL + 1
        assert (await c.run_cycle()).action == "promoted"

    run(main())


def test_a_member_whose_record_expired_holds_nobody_back() -> None:
    async def main() -> None:
        clock, fake, _, _, c = await three_nodes(b_seq=1900, c_seq=1200)
        clock.now += TTL + 1  # b stopped cycling (paused, cut off): its record is gone with a's lease
        decision = await c.run_cycle()
        assert decision.action == "promoted"
        assert [m.name for m in await fake.members()] == ["c"]

    run(main())


def test_a_backup_whose_promotion_fails_stops_holding_the_others_back() -> None:
    async def main() -> None:
        clock, fake, _, b, c = await three_nodes(b_seq=1900, c_seq=1200)
        b.hooks.fail_promotion = True  # type: ignore[attr-defined]
        clock.now += TTL + 1
        assert "the promotion failed" in (await b.run_cycle()).reason  # its record still says candidate
        held = await c.run_cycle()  # b took the lease last and may have served: c waits for it
        assert held.action == "wait" and held.waiting_for == ("b",), held
        await b.run_cycle()  # publishes itself as no candidate (it still tries, and fails)
        assert not fake.records["b"][0].candidate
        assert (await c.run_cycle()).action == "promoted"
        assert (await b.run_cycle()).action == "follow"
        assert not b.record().candidate  # c has not said IN_SYNC yet
        b.hooks.is_caught_up = True  # type: ignore[attr-defined]  # c's IN_SYNC
        assert b.record().candidate, "a new term: b may take over again (its next record says so)"

    run(main())


def test_a_backup_caught_up_with_an_earlier_primary_is_not_caught_up_once_another_took_the_lease() -> None:
    """docs/replication.md, Caught up with the last primary: c followed a; b took the lease and served (in
    async mode it deleted the set) while c never cycled; with b gone too, c is not caught up with the last
    primary: no candidate, and it waits for b instead of taking the lease with what only a told it."""

    async def main() -> None:
        clock, fake, _, b, c = await three_nodes(b_seq=1900, c_seq=1200)
        clock.now += TTL + 1  # a is gone
        assert (await b.run_cycle()).action == "promoted" and fake.last_primary == "b"
        clock.now += TTL + 1  # b is gone too, before c's next cycle
        decision = await c.run_cycle()
        assert decision.action == "wait" and decision.waiting_for == ("b",), decision
        assert c.hooks.promoted == 0 and not c.record().candidate  # type: ignore[attr-defined]
        assert c.caught_up_earlier
        await fake.publish_member(replace(b.record(), role="backup", promotion_failed=True))
        assert (await c.run_cycle()).action == "promoted"  # had b never served (its entry says so), a was the last

    run(main())


def test_a_backup_caught_up_with_an_earlier_term_of_the_last_primary_is_not_caught_up() -> None:
    """Review 260 (ABA): c followed a in its first term and was frozen; b took over and served, a
    restarted, followed b, took the lease again and served, and died. The last primary's NAME is
    the one c followed, but not its term: c lacks what b and a's later term acknowledged."""

    async def main() -> None:
        clock, fake, _, b, c = await three_nodes(b_seq=1900, c_seq=1200)
        assert fake.sync is None  # async mode: no synchronous set
        clock.now += TTL + 1  # a is gone (SIGKILL); c is frozen from here
        assert (await b.run_cycle()).action == "promoted" and fake.last_primary == "b"  # b acknowledges X
        a2 = node(fake, Hooks(seq=2500), "a")  # a restarted: it follows b and is caught up with it
        assert (await a2.run_cycle()).action == "follow"
        clock.now += TTL + 1  # b is gone
        assert (await a2.run_cycle()).action == "promoted" and fake.last_primary == "a"  # acknowledges Y
        clock.now += TTL + 1  # a is gone again; c resumes, caught up by its own view (with a's first term)
        decision = await c.run_cycle()
        assert decision.action == "wait" and c.hooks.promoted == 0, decision  # type: ignore[attr-defined]
        assert c.caught_up_earlier and not c.record().candidate

    run(main())


def test_every_member_publishes_its_position_and_role() -> None:
    async def main() -> None:
        _, fake, a, _, _ = await three_nodes(b_seq=5, c_seq=4)
        a.hooks.seq = 6  # type: ignore[attr-defined]
        await a.run_cycle()
        assert sorted(await fake.members(), key=lambda m: m.name) == [
            Member("a", "primary", 7, 6, False, "a:7000"), member("b", 5), member("c", 4),
        ]  # fmt: skip
        assert [m.name for m in a.members] == ["a", "b", "c"]

    run(main())


# --- what the operator reads -----------------------------------------------------------------


def ha_records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "amqtt_durable.replication"]


def run_cycles(ha: HaNode, clock: Clock, script: dict[int, object], cycles: int) -> None:
    """``ha.run`` for ``cycles`` cycles, one fake second each; ``script[n]`` is called after cycle n."""

    async def main() -> None:
        stop = asyncio.Event()
        done = 0

        def decided(_: Decision) -> None:
            nonlocal done
            done += 1
            clock.now += 1.0
            step = script.get(done)
            if callable(step):
                step()
            if done == cycles:
                stop.set()

        ha.loop_wait = 0.001
        await asyncio.wait_for(ha.run(stop, decided), 10)

    asyncio.run(main())


def down(fake: FakeCoordinator, value: bool) -> object:
    return lambda: setattr(fake, "down", value)


def test_an_unreachable_coordinator_is_one_warning_for_a_backup_then_one_line_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="amqtt_durable.replication")
    clock = Clock()
    fake = FakeCoordinator(clock)
    fake.holder, fake.expires = Leader("x", "x:7000"), float("inf")
    ha = node(fake, Hooks(), "b")
    run_cycles(ha, clock, {2: down(fake, True), 7: down(fake, False)}, 10)
    loud = [(level, text) for level, text in ha_records(caplog) if level > logging.DEBUG]
    assert [level for level, _ in loud] == [logging.WARNING, logging.INFO], loud
    assert "the coordinator does not answer (coordinator fake: connection refused" in loud[0][1]
    assert loud[1][1] == "replication HA b: the coordinator answers again after 5.0 s"
    quiet = [text for level, text in ha_records(caplog) if level == logging.DEBUG]
    assert sum("does not answer" in text for text in quiet) == 4


def test_an_unreachable_coordinator_is_one_warning_for_a_primary_then_one_line_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="amqtt_durable.replication")
    clock = Clock()
    fake = FakeCoordinator(clock)
    ha = node(fake, Hooks())
    # cycle 1 bootstraps; 2-4 cannot renew (3 fake seconds: the lease is ours 8 s); 5 renews
    run_cycles(ha, clock, {1: down(fake, True), 4: down(fake, False)}, 6)
    assert ha.role == "backup"  # the run ended: it stepped down
    loud = [(level, text) for level, text in ha_records(caplog) if level > logging.DEBUG]
    assert [level for level, _ in loud] == [logging.INFO, logging.WARNING, logging.INFO], loud
    assert "took the leader lease" in loud[0][1]
    assert "could not renew the leader lease" in loud[1][1] and "still primary" in loud[1][1]
    assert loud[2][1] == "replication HA a: the coordinator answers again after 3.0 s"


def test_a_reason_repeated_from_the_previous_cycle_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="amqtt_durable.replication")
    clock = Clock()
    fake = FakeCoordinator(clock)
    fake.initialized_by = "old"
    hooks = Hooks(caught_up=False)
    run_cycles(node(fake, hooks), clock, {2: lambda: setattr(hooks, "is_caught_up", True)}, 4)
    records = ha_records(caplog)
    # waiting because it is not known to be caught up is a WARNING (docs/replication.md), once
    assert [level for level, _ in records] == [logging.WARNING, logging.DEBUG, logging.INFO, logging.DEBUG], records
    assert "not caught up" in records[0][1] and "took the leader lease" in records[2][1]


def test_inspect_shows_the_members_positions() -> None:
    status = {
        "name": "b", "role": "backup", "state": "disconnected", "batch": 1200, "caught_up": True, "primary": None,
        "members": [
            {"name": "b", "role": "backup", "store_id": 0x5EED, "batch": 1200, "candidate": True},
            {"name": "c", "role": "backup", "store_id": 0x5EED, "batch": 1900, "candidate": False},
        ],
    }  # fmt: skip
    assert format_status(status).splitlines()[2:] == [
        "  members in the coordinator (as of this node's last HA cycle):",
        "    b: backup, at batch 1200, store 5eed, may take over",
        "    c: backup, at batch 1900, store 5eed",
    ]
    assert format_status({**status, "members": []}).splitlines()[-1] == "  no member in the coordinator (yet)"


class FailsFirstPromotion(Hooks):
    async def promote(self) -> None:
        self.promoted += 1
        if self.promoted == 1:
            raise OSError("replication port in use")


def test_a_failed_bootstrap_does_not_let_a_lagging_node_take_over_after_it_followed_another() -> None:
    """Review (helper-32): the failed bootstrap's flag outlived the term of the primary this node
    then followed; when that primary died, the node (not caught up) skipped the bootstrap gate."""

    async def main() -> None:
        clock = Clock()
        coordinator = FakeCoordinator(clock)
        hooks = FailsFirstPromotion(caught_up=False)  # a new cluster: nobody caught up yet
        ha = node(coordinator, hooks)
        assert (await ha.run_cycle()).action == "wait"  # bootstrapped, but the promotion failed
        assert await coordinator.acquire(Leader("b", "b:7000"))  # b takes the lease (and is its last taker)
        assert (await ha.run_cycle()).action == "follow"
        clock.now += TTL + 1  # b is gone; this node never caught up with it
        await ha.run_cycle()
        assert ha.role == "backup", "a backup that is not caught up took the lease"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_node_whose_name_another_broker_publishes_under_waits_with_an_error_and_a_primary_serves_on() -> None:
    """docs/replication.md, One name, one backup: members/<name> at another address is another
    broker's; a backup takes no primary to follow and never takes over until that record ends; a
    primary keeps its lease; the leader key under the node's own name is said as before."""

    async def main() -> None:
        clock, fake, _, primary = await a_primary()
        assert (await node(fake, Hooks(), "b").run_cycle()).action == "follow"

        def twin_of(name: str) -> tuple[Hooks, HaNode]:
            hooks = Hooks()
            return hooks, HaNode(
                fake, hooks, name=name, address="x:7000", loop_wait=1.0, demote_margin=MARGIN, clock=clock
            )

        twin_hooks, twin = twin_of("b")
        decision = await twin.run_cycle()
        assert (decision.action, decision.level) == ("wait", logging.ERROR)
        assert "another broker publishes its position under this node's name, b, at b:7000" in decision.reason
        assert "or this node restarted at a new address: that record ends within lease_ttl" in decision.reason
        assert twin_hooks.followed == [] and twin_hooks.promoted == 0 and twin.role == "backup"
        assert fake.records["b"][0].address == "b:7000"  # left as it was

        reason = (await twin_of("a")[1].run_cycle()).reason  # the primary's name: the leader key's check
        assert reason.startswith("another broker holds the leader lease under this node's name, a, at a:7000")

        other = Member("a", "backup", 7, 0, False, "x:7000")
        fake.records["a"] = (other, clock() + TTL)  # another broker's record under the primary's name
        assert (await primary.run_cycle()).action == "renewed"  # the lease decides: still primary
        assert fake.records["a"][0] == other

        clock.now += TTL  # b's record ends (b stopped): the twin publishes its own and follows a
        fake.expires = clock() + TTL
        assert (await twin.run_cycle()).action == "follow" and twin_hooks.followed == [Leader("a", "a:7000")]

    run(main())


# --- after a full stop of the group: no primary, nobody caught up (docs/replication.md) ---------


def full_stop(sync: frozenset[str] | None = frozenset({"b"})) -> tuple[Clock, FakeCoordinator]:
    """A cluster whose primary "a" (the last to take the lease; in sync mode it published ``sync``)
    and every backup stopped: no lease, no member record left."""
    clock = Clock()
    fake = FakeCoordinator(clock)
    fake.initialized_by, fake.last_primary = "a", "a"
    if sync is not None:
        fake.sync, fake.sync_leader = sync, "a"
    return clock, fake


def restarted(fake: FakeCoordinator, name: str, seq: int, *, whole: bool = True) -> tuple[Hooks, HaNode]:
    hooks = Hooks(caught_up=False, seq=seq, whole=whole)
    return hooks, node(fake, hooks, name)


def test_after_a_full_stop_a_node_that_may_lack_acknowledged_publishes_waits_with_a_warning() -> None:
    async def main() -> None:
        _, fake = full_stop()
        hooks, c = restarted(fake, "c", 500)  # not the last primary, not in its synchronous set
        decision = await c.run_cycle()
        assert (decision.action, decision.level) == ("wait", logging.WARNING)
        assert "nor the last primary or in its synchronous set (a, b): it may lack acknowledged" in decision.reason
        assert (hooks.promoted, fake.holder) == (0, None)
        _, unknown = full_stop(None)
        unknown.last_primary = None  # an earlier version's async cluster: no former primary recorded
        decision = await restarted(unknown, "a", 500)[1].run_cycle()
        assert (decision.action, decision.level) == ("wait", logging.WARNING)
        assert "the coordinator names no former primary" in decision.reason
        _, whole_not = full_stop()
        decision = await restarted(whole_not, "b", 0, whole=False)[1].run_cycle()  # in the set, store empty
        assert (decision.action, decision.level) == ("wait", logging.WARNING)
        assert "its store holds no whole replicated history" in decision.reason and whole_not.holder is None

    run(main())


def test_after_a_full_stop_a_member_of_the_synchronous_set_alone_takes_over_after_waiting_for_the_others() -> None:
    async def main() -> None:
        clock, fake = full_stop()
        hooks, b = restarted(fake, "b", 400)
        decision = await b.run_cycle()
        assert decision.action == "wait" and "waiting up to 10 s for a (the last primary" in decision.reason
        clock.now += TTL - 0.5
        assert (await b.run_cycle()).action == "wait"
        clock.now += 0.5
        decision = await b.run_cycle()
        assert decision.action == "promoted" and "after a full stop of the group" in decision.reason
        assert (hooks.promoted, fake.holder, fake.last_primary) == (1, Leader("b", "b:7000"), "b")

    run(main())


def test_after_a_full_stop_the_most_advanced_takes_over_and_the_last_primary_wins_a_tie() -> None:
    async def main() -> None:
        for a_seq, b_seq, expected in ((400, 410, "b"), (410, 400, "a"), (400, 400, "a")):
            _, fake = full_stop()
            a_hooks, a = restarted(fake, "a", a_seq)
            b_hooks, b = restarted(fake, "b", b_seq)
            await a.run_cycle()  # each publishes its record: both are running
            await b.run_cycle()
            await a.run_cycle()
            await b.run_cycle()
            assert (a_hooks.promoted, b_hooks.promoted) == ((1, 0) if expected == "a" else (0, 1)), (a_seq, b_seq)
            assert fake.holder is not None and fake.holder.name == expected

    run(main())


def test_after_a_full_stop_in_async_mode_only_the_last_primary_takes_over() -> None:
    async def main() -> None:
        clock, fake = full_stop(None)
        b_hooks, b = restarted(fake, "b", 390)
        a_hooks, a = restarted(fake, "a", 400)
        for _ in range(3):
            await b.run_cycle()
            clock.now += TTL
        assert (b_hooks.promoted, fake.holder) == (0, None)
        await a.run_cycle()  # the lease's last holder: whatever was acknowledged, it acknowledged it
        assert (a_hooks.promoted, fake.holder) == (1, Leader("a", "a:7000"))

    run(main())


def test_after_a_full_stop_of_an_earlier_versions_cluster_the_synchronous_sets_writer_takes_over() -> None:
    """docs/replication.md (a rolling upgrade with a coordinator): an earlier version recorded no
    last primary; in sync mode the synchronous set names its writer, which takes the lease."""

    async def main() -> None:
        clock, fake = full_stop(frozenset())  # the backups were gone: the primary acknowledged alone
        fake.last_primary = None
        b_hooks, b = restarted(fake, "b", 300)
        a_hooks, a = restarted(fake, "a", 420)
        decision = await b.run_cycle()
        assert (decision.action, decision.level) == ("wait", logging.WARNING)
        assert await a.run_cycle() == Decision(
            "promoted",
            "no primary after a full stop of the group, and this node holds every acknowledged publish (the last "
            "primary or in its synchronous set) and is the most advanced: took the leader lease, now primary",
        )
        assert (a_hooks.promoted, b_hooks.promoted, fake.last_primary) == (1, 0, "a")
        clock.now += 1
        assert (await b.run_cycle()).action == "follow"

    run(main())


def test_a_promote_arriving_while_a_cycle_reads_the_coordinator_is_accepted() -> None:
    """Review 236: every backup cycle cleared the "found no primary" mark at its start, so a
    PROMOTE arriving while the cycle waited for the coordinator was refused (6.3% of them at
    random times) though nothing had changed. The mark is the coordinator's last answer now."""

    async def main() -> None:
        _, fake = full_stop()
        hooks, c = restarted(fake, "c", 500)
        assert (await c.run_cycle()).action == "wait"  # no primary
        fake.hang = asyncio.Event()
        cycle = asyncio.ensure_future(c.run_cycle())
        for _ in range(5):  # the cycle runs into the coordinator's first call and waits there
            await asyncio.sleep(0)
        assert not cycle.done()
        assert c.request_takeover() is None, "refused mid-cycle"
        fake.hang.set()
        assert (await cycle).action == "promoted" and hooks.promoted == 1

        _, fake = full_stop()
        _, d = restarted(fake, "d", 500)
        fake.down = True
        assert (await d.run_cycle()).unanswered
        assert d.request_takeover() is not None  # its last cycle could not tell
        fake.down = False
        assert await fake.acquire(Leader("a", "a:7000"))
        assert (await d.run_cycle()).action == "follow"
        assert d.request_takeover() is not None  # a primary holds the lease

    run(main())


def test_after_a_full_stop_a_last_primary_whose_promotion_fails_holds_a_synchronous_backup_back_no_longer() -> None:
    """Review 236: a (the last primary, batch 410) cannot become primary (its store will not load,
    its port is taken): it took and released the lease every cycle, and b (in the synchronous
    set, batch 400, holding every acknowledged publish) deferred to it forever. A node publishes
    its failed promotion; such a member holds nobody back."""

    async def main() -> None:
        clock, fake = full_stop()
        a_hooks, a = restarted(fake, "a", 410)
        a_hooks.fail_promotion = True
        b_hooks, b = restarted(fake, "b", 400)
        for _ in range(4):
            await a.run_cycle()
            await b.run_cycle()
            clock.now += 1
        assert b_hooks.promoted == 1 and fake.holder == Leader("b", "b:7000"), b.last
        assert fake.records["a"][0].promotion_failed
        assert (await a.run_cycle()).action == "follow" and not a.record().promotion_failed  # a new term

    run(main())


def test_a_node_in_async_mode_removes_the_synchronous_set_once_its_promotion_succeeded() -> None:
    """Review 236: async primaries publish no synchronous set, so one left from an earlier period
    in sync mode stayed, and after a full stop its members (far behind the async primary, which
    acknowledged alone) counted as holding every acknowledged publish. A node in async mode
    removes it once promoted, before its first acknowledgement (its primary end does:
    ``publish_sync(me, None)``, done here as the hooks' promote); one in sync mode keeps it until
    it publishes its own. Taking the lease alone keeps it (review 246)."""

    async def main() -> None:
        clock, fake = full_stop(frozenset({"b"}))  # the sync-mode period: a published {b}
        fake.initialized_by = "a"
        kept = node(fake, Hooks(caught_up=True), "b")  # sync mode: keeps the set until it publishes
        kept._followed = ("a", 0)  # caught up with a, in the sync-mode period
        assert (await kept.run_cycle()).action == "promoted" and fake.sync == frozenset({"b"})
        fake.holder = None
        a_hooks = Hooks(caught_up=True, seq=100_000)
        a = HaNode(fake, a_hooks, name="a", address="a:7000", loop_wait=1.0, demote_margin=MARGIN,
                   clock=clock)  # fmt: skip
        fake.sync, fake.sync_leader = frozenset({"a"}), "b"  # b's set, in its sync-mode period
        a._followed = ("b", 0)  # caught up with b
        assert (await a.run_cycle()).action == "promoted" and fake.sync == frozenset({"a"})
        assert await fake.publish_sync(a.me, None) and (fake.sync, fake.sync_leader) == (None, None)
        assert not await fake.publish_sync(kept.me, None)  # only the leader deletes it
        fake.holder = None  # a full stop: a acknowledged alone meanwhile
        clock.now += TTL
        b_hooks, b = restarted(fake, "b", 5)
        for _ in range(3):
            decision = await b.run_cycle()
            clock.now += TTL
        assert b_hooks.promoted == 0 and "synchronous set (a)" in decision.reason, decision

    run(main())


def test_after_a_full_stop_the_wait_for_the_others_restarts_after_a_stale_record_or_an_unanswered_cycle() -> None:
    """docs/replication.md: a node that may take over waits up to lease_ttl from the first of its
    cycles in a row that find no primary and let it take over. Review 236: the wait began at the
    first cycle even when a peer's record from before the stop held it back, or etcd did not
    answer, so once that record expired (or etcd answered) it took the lease at once."""

    async def main() -> None:
        clock, fake = full_stop()
        stale = Member("a", "primary", 7, 410, False, "a:7000")  # a's record from before the kill
        fake.records["a"] = (stale, clock() + TTL - 1)
        hooks, b = restarted(fake, "b", 400)
        assert "a holds every acknowledged publish too and is further ahead" in (await b.run_cycle()).reason
        clock.now += TTL - 0.5  # the record expired: the wait for a starts now
        assert "waiting up to 10 s for a" in (await b.run_cycle()).reason
        clock.now += TTL - 1
        assert (await b.run_cycle()).action == "wait"
        fake.down = True
        clock.now += 2
        assert (await b.run_cycle()).unanswered
        fake.down = False  # etcd answers again: a row of cycles begins again
        assert "waiting up to 10 s for a" in (await b.run_cycle()).reason
        clock.now += TTL
        assert (await b.run_cycle()).action == "promoted" and hooks.promoted == 1

    run(main())


class AcquireHeld(FakeCoordinator):
    """Its ``acquire`` waits for ``go``: a PROMOTE can arrive after the cycle decided."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.go = asyncio.Event()
        self.acquiring = asyncio.Event()

    async def acquire(self, me: Leader) -> bool:
        self.acquiring.set()
        await self.go.wait()
        return await super().acquire(me)


def test_a_promote_accepted_while_the_node_takes_the_lease_by_itself_leaves_no_takeover_for_later() -> None:
    """A PROMOTE accepted mid-cycle, after the cycle had decided to take the lease on its own: the
    request is done with once the lease is taken, so after a later demotion the node does not
    take a free lease without the checks; a demoted node accepts no promote before a backup cycle."""

    async def main() -> None:
        clock = Clock()
        fake = AcquireHeld(clock)
        fake.initialized_by = "old"
        ha = node(fake, Hooks(caught_up=True))
        fake.go.set()
        assert (await ha.run_cycle()).action == "promoted"
        clock.now += TTL  # its lease ends: demoted
        assert (await ha.run_cycle()).action == "demoted"
        assert ha.request_takeover() is not None  # no backup cycle since its term
        fake.go.clear()
        fake.acquiring.clear()
        cycle = asyncio.ensure_future(ha.run_cycle())  # the last primary, no primary: it takes the lease itself
        await asyncio.wait_for(fake.acquiring.wait(), 5)
        assert ha.request_takeover() is None  # accepted: its last answer found no primary
        fake.go.set()
        assert (await cycle).action == "promoted" and "operator" not in cycle.result().reason
        assert not ha._operator_takeover

    run(main())


def test_a_failed_promotion_in_async_mode_leaves_the_synchronous_set() -> None:
    """Review 246: a node in async mode deleted the set when it took the lease; its promotion
    failed, the lease was released, and c, caught up by its own view but outside the set (dropped
    for being slow, at batch 95 of 100), took over without the acknowledged batches it lacked."""

    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        fake.initialized_by = fake.last_primary = "s"
        fake.sync, fake.sync_leader = frozenset({"a", "b"}), "s"
        c_hooks = Hooks(caught_up=True, seq=95)
        c = node(fake, c_hooks, "c")
        c._followed = ("s", 0)  # caught up with s, by its own view
        assert "not in the synchronous set" in (await c.run_cycle()).reason
        a_hooks = Hooks(caught_up=True, seq=100)
        a_hooks.fail_promotion = True
        a = HaNode(fake, a_hooks, name="a", address="a:7000", loop_wait=1.0, demote_margin=MARGIN,
                   clock=clock)  # fmt: skip
        a._followed = ("s", 0)  # caught up with s
        assert "the promotion failed" in (await a.run_cycle()).reason and fake.holder is None
        assert fake.sync == frozenset({"a", "b"}), "a failed promotion keeps the set"
        clock.now += 1
        await a.run_cycle()
        clock.now += 1
        decision = await c.run_cycle()
        assert c_hooks.promoted == 0 and "not in the synchronous set" in decision.reason, decision

    run(main())


def test_a_full_stops_wait_begins_anew_after_the_nodes_own_term() -> None:
    """Review 246: the start of a full stop's wait survived the node's term, so after a later
    demotion its first cycle finding no primary took the lease without waiting lease_ttl for b."""

    async def main() -> None:
        clock, fake = full_stop()
        _, a = restarted(fake, "a", 410)
        assert "waiting up to" in (await a.run_cycle()).reason
        clock.now += TTL
        assert (await a.run_cycle()).action == "promoted"
        clock.now += TTL  # the lease not renewed: demoted
        assert (await a.run_cycle()).action == "demoted"
        clock.now += 1
        decision = await a.run_cycle()
        assert "waiting up to" in decision.reason, decision

    run(main())


@pytest.mark.parametrize("cause", ["no answer", "name taken"])
def test_a_cycle_without_the_coordinators_answer_voids_an_accepted_promote(cause: str) -> None:
    """docs/replication.md: a cycle that gets no answer voids an accepted promote (the operator
    runs it again). Review 246: one accepted before 50 cycles without etcd took the lease at the
    first answer, on a state nobody looked at."""

    async def main() -> None:
        _, fake = full_stop()
        hooks, c = restarted(fake, "c", 500)
        assert (await c.run_cycle()).action == "wait"
        assert c.request_takeover() is None
        if cause == "no answer":
            fake.down = True
            for _ in range(3):
                assert (await c.run_cycle()).unanswered
                fake.clock.now += 1
            fake.down = False
        else:
            fake.records["c"] = (Member("c", "backup", 7, 1, False, "elsewhere:7000"), fake.clock() + 2.5)
            assert "under this node's name" in (await c.run_cycle()).reason
            fake.clock.now += 3
        decision = await c.run_cycle()
        assert hooks.promoted == 0 and decision.action == "wait", decision

    run(main())


def test_a_promote_accepted_while_the_node_takes_the_lease_by_itself_is_said_void_when_that_promotion_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/replication.md: such a promote is done with when the lease is taken; a failed promotion
    says that it is void (the operator runs it again), and the next cycle takes no lease unchecked."""

    async def main() -> None:
        clock = Clock()
        fake = AcquireHeld(clock)
        fake.initialized_by = "old"
        hooks = Hooks(caught_up=True)
        hooks.fail_promotion = True
        ha = node(fake, hooks)
        fake.go.set()
        assert (await ha.run_cycle()).action == "wait"  # no promote yet: its promotion failed
        fake.go.clear()
        fake.acquiring.clear()
        cycle = asyncio.ensure_future(ha.run_cycle())  # it takes the lease itself again
        await asyncio.wait_for(fake.acquiring.wait(), 5)
        assert ha.request_takeover() is None
        fake.go.set()
        assert "the promotion failed" in (await cycle).reason and not ha._operator_takeover

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        run(main())
    assert "that promotion failed: the promote is void (run it again)" in caplog.text


def test_a_last_primary_restarted_while_a_caught_up_backup_runs_leaves_the_lease_to_it() -> None:
    """docs/replication.md: the old primary, when it comes back, rejoins as a backup. Once the
    full-stop rule existed, a primary SIGKILLed and restarted before its backup's cycle took the
    free lease won it back on equal positions (the fleet's primary_kill run: "restarted: a primary")."""

    async def main() -> None:
        for sync in (frozenset({"b"}), None):
            _, fake = full_stop(sync)
            b_hooks = Hooks(caught_up=True, seq=400)
            b = node(fake, b_hooks, "b")
            fake.holder, fake.expires = Leader("a", "a:7000"), fake.clock() + TTL
            assert (await b.run_cycle()).action == "follow"  # b is in sync with a: its record says candidate
            fake.holder = None  # a is SIGKILLed, its lease gone
            a_hooks, a = restarted(fake, "a", 400)  # restarted: not caught up, the last primary
            decision = await a.run_cycle()
            assert decision.action == "wait" and "b is a caught-up backup that takes the lease" in decision.reason
            assert (await b.run_cycle()).action == "promoted"
            assert (a_hooks.promoted, b_hooks.promoted, fake.holder) == (0, 1, Leader("b", "b:7000"))
        # Review 252: in async mode a last primary further ahead (it acknowledged 401-500 alone)
        # does not wait for a backup behind it: the full-stop rule lets it keep what it acknowledged.
        _, fake = full_stop(None)
        b = node(fake, Hooks(caught_up=True, seq=400), "b")
        fake.holder, fake.expires = Leader("a", "a:7000"), fake.clock() + TTL
        assert (await b.run_cycle()).action == "follow"
        fake.holder = None
        a_hooks, a = restarted(fake, "a", 500)
        assert (await a.run_cycle()).action == "promoted"
        assert (a_hooks.promoted, fake.holder) == (1, Leader("a", "a:7000"))

    run(main())


class LostRaceCoordinator(FakeCoordinator):
    """Its next acquire fails as etcd's does when another node took the lease and gave it up
    between the cycle's read that found no leader and its transaction."""

    lose_next = True

    async def acquire(self, me: Leader) -> bool:
        if self.lose_next:
            self.lose_next = False
            await self._reach()
            self.terms += 1  # the other node's term
            return False
        return await super().acquire(me)


def test_a_caught_up_backup_whose_acquire_finds_the_lease_taken_since_it_looked_waits_then_decides_again() -> None:
    """docs/replication.md: the acquire transaction fails when the lease was taken (and maybe given up)
    since the cycle found no primary; the node stays a backup and its next cycle decides anew."""

    async def main() -> None:
        fake = LostRaceCoordinator(Clock())
        hooks, ha = caught_up_backup(fake)
        decision = await ha.run_cycle()
        assert decision.action == "wait" and "took it and gave it up since this cycle found no primary" in (
            decision.reason
        ), decision
        assert (ha.role, hooks.promoted, fake.holder) == ("backup", 0, None)
        assert (await ha.run_cycle()).action == "promoted"
        assert (ha.role, hooks.promoted) == ("primary", 1)

    run(main())


def test_an_operators_promote_whose_acquire_finds_the_lease_taken_since_it_looked_is_said_void(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/replication.md: an accepted promote is void, with a WARNING, when the lease was taken
    between the cycle's look and its transaction (review 277: it was used up silently); it is
    not taken up again by a later cycle."""

    async def main() -> None:
        _, plain = full_stop()
        fake = LostRaceCoordinator(plain.clock)
        fake.initialized_by, fake.last_primary, fake.sync, fake.sync_leader = "a", "a", plain.sync, "a"
        hooks, c = restarted(fake, "c", 500)
        assert (await c.run_cycle()).action == "wait"
        fake.lose_next = True
        assert c.request_takeover() is None
        with caplog.at_level(logging.WARNING):
            assert (await c.run_cycle()).action == "wait"
        assert "the operator's promote is void: another node took the leader lease first" in caplog.text
        assert (await c.run_cycle()).action == "wait" and hooks.promoted == 0

    run(main())


@pytest.mark.parametrize(
    ("kind", "value", "said"),
    [
        (int, "1", "'f' is not an integer: a string \"1\""),
        (int, True, "'f' is not an integer: a boolean true"),
        (str, 1, "'f' is not a string: a number 1"),
        (bool, 1, "'f' is not a boolean: a number 1"),
        (bool, "\ud800\n", "'f' is not a boolean: a string \"\\ud800\\n\""),
        (list, ["a", 1], "'f' is not an array of strings: an array"),
    ],
)
def test_a_record_field_of_another_kind_is_named_in_jsons_words(kind: type, value: object, said: str) -> None:
    """A record from outside the process (etcd, a node's answer) is refused naming the field and what it
    asks for in JSON's words, as whoever wrote the record knows them (review 326: only the boolean was
    checked); a value is shown as JSON writes it, escaped (a boolean ``true``, not Python's ``True``)."""
    with pytest.raises(ValueError, match="^" + re.escape(said) + "$"):
        record_field({"f": value}, "f", kind)
