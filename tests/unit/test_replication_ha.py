"""The HA decisions (ha.HaNode), with the coordinator faked at its interface and a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from amqtt_durable.replication.coordinator import Coordinator, Leader
from amqtt_durable.replication.errors import CoordinatorError
from amqtt_durable.replication.ha import HaNode

TTL = 10.0
MARGIN = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeCoordinator(Coordinator):
    """One leader key under a lease that expires ``ttl`` after its last renewal, on ``clock``."""

    def __init__(self, clock: Clock, ttl: float = TTL) -> None:
        self.clock = clock
        self.ttl = ttl
        self.holder: Leader | None = None
        self.expires = 0.0
        self.initialized_by: str | None = None
        self.sync: frozenset[str] | None = None
        self.down = False
        self.hang: asyncio.Event | None = None

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
        self.holder, self.expires = me, self.clock() + self.ttl
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

    async def publish_sync(self, me: Leader, members: frozenset[str]) -> bool:
        await self._reach()
        if self.holder != me:
            return False
        self.sync = members
        return True

    async def sync_members(self) -> frozenset[str] | None:
        await self._reach()
        return self.sync

    async def initialize(self, name: str) -> bool:
        await self._reach()
        if self.initialized_by is None:
            self.initialized_by = name
            return True
        return False


class Hooks:
    def __init__(self, *, caught_up: bool = True) -> None:
        self.is_caught_up = caught_up
        self.followed: list[Leader] = []
        self.promoted = 0
        self.demoted: list[str] = []
        self.demoted_event = asyncio.Event()

    def caught_up(self) -> bool:
        return self.is_caught_up

    def follow(self, leader: Leader) -> None:
        self.followed.append(leader)

    async def promote(self) -> None:
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
    return clock, fake, hooks, ha


def run(coro: object) -> object:
    async def main() -> object:
        return await asyncio.wait_for(coro, 10)  # type: ignore[arg-type]

    return asyncio.run(main())


def test_a_caught_up_backup_takes_a_free_lease() -> None:
    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        fake.initialized_by = "old"
        hooks = Hooks(caught_up=True)
        ha = node(fake, hooks)
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
        fake.holder, fake.expires = Leader("a", "old:7000"), clock.now + TTL
        restarted = node(fake, Hooks())
        decision = await restarted.run_cycle()
        assert decision.action == "wait"
        assert "before it restarted" in decision.reason
        other = node(fake, Hooks(), "b")
        assert (await other.run_cycle()).reason == "following primary a at old:7000"

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
        clock.now += TTL + 1  # a is gone, its lease expired
        decision = await b.run_cycle()
        assert decision.action == "wait"
        assert "not in the synchronous set" in decision.reason
        assert (await c.run_cycle()).action == "promoted"

    run(main())
