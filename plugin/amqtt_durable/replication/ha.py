"""One step of high availability: read the cluster state, decide, act, say why (Patroni's ha.py).

``HaNode.run_cycle`` is called every ``loop_wait`` seconds; each call returns a
``Decision`` whose ``reason`` is logged and shown by inspect. The broker gives the node its
hooks: ``caught_up()`` (the backup end says IN_SYNC), ``position()`` (store id, last batch),
``store_whole()`` (a replicated history, no half-applied snapshot),
``follow(leader)``, ``promote()`` and ``demote(reason)``. Nothing of this runs without a
coordinator configured.

Safety before availability, the timing argument. A primary records ``t0`` (its monotonic
clock) *before* it sends a renewal; etcd restarts the lease's TTL when it receives the
request, at real time >= t0, so once the reply says the lease lives, nobody else can
acquire it before ``t0 + ttl``. The primary keeps acknowledging only while
``now < t0 + ttl - demote_margin`` (``may_acknowledge``) and demotes itself at that moment
at the latest, by a timer that does not depend on the cycle or on etcd answering. Another
node can take the lease only after etcd expired it, that is after ``t0 + ttl`` (an etcd
leader change only extends leases). So the old primary has stopped acknowledging
``demote_margin`` seconds before any other node can be primary; the margin absorbs the
rate difference of the two clocks (ppm) and the time to stop the acknowledging path
(one loop pass: ``demote`` must stop acknowledgements synchronously). Renewals happen every
``loop_wait`` seconds, each bounded by the time left before the demotion deadline, so with
``loop_wait <= (ttl - demote_margin) / 2`` a primary gets at least two attempts before it
must step down.

A backup takes the lease only when no node holds it, it is caught up (in sync with the last
primary: the leader it followed, in the same term, is the last to take the lease or the set's
leader, or each of those says its promotion failed, ``_caught_up_with_last_primary``), in sync mode it is in the
synchronous set that primary published before it acknowledged anything without a backup (so
it holds every acknowledged batch), and no other
live candidate of the same store is further ahead (``ahead_of``: every node publishes its
position each cycle, Patroni's member keys; in async mode the most advanced backup holds the
most acknowledged publishes); or when it bootstraps a new cluster (the one-time
``initialize`` claim); or, not caught up, after a full stop of the group (``_after_full_stop``:
the last primary or a member of its synchronous set, the most advanced running); or when the
operator's ``promote`` asked it to (``request_takeover``: no check that it holds every
acknowledged publish, the lease still taken atomically). A backup's published position is final
one cycle after the primary died, well before the lease can expire (``loop_wait <= (ttl - demote_margin) / 2``).

Logging (``run``): a decision whose reason repeats the previous cycle's is logged at DEBUG;
the coordinator not answering is one WARNING when it starts and one INFO line when it
answers again, whatever the role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from .coordinator import Coordinator, Leader, Member
from .errors import CoordinatorError, MemberNameTakenError, PromotionStoppedError

log = logging.getLogger("amqtt_durable.replication")

Role = Literal["primary", "backup"]
Action = Literal["renewed", "retry", "demoted", "follow", "wait", "promoted", "bootstrapped", "stopped"]
"""A failed promotion is a "wait" (logged as an ERROR when it happens); one ended by the
broker's stop is "stopped"."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    unanswered: bool = False
    """The coordinator did not answer this cycle (unreachable, refused, too slow)."""
    level: int | None = None
    """The level to log it at, when not the action's (a configuration error is an ERROR)."""
    waiting_for: tuple[str, ...] = ()
    """A wait for other nodes: the ones this node leaves the lease to or waits for (to start, or
    to be primary again), by name; inspect shows them."""


class HaHooks(Protocol):
    """What the broker does on the HA loop's decisions."""

    def caught_up(self) -> bool:
        """The backup end was told IN_SYNC by the last primary and applied all it received."""

    def position(self) -> tuple[int, int]:
        """(store id, last batch) of this node's store: a primary's newest, a backup's last applied."""

    def store_whole(self) -> bool:
        """The store holds a whole replicated history: at least one batch, no snapshot half applied."""

    def follow(self, leader: Leader) -> None:
        """Replicate from ``leader`` (reconnect the backup end if it follows another)."""

    async def promote(self) -> None:
        """Become primary: stop the backup end, start the primary end, accept clients. Raises
        (and is left a backup) when the broker cannot serve: the HA loop releases the lease;
        PromotionStoppedError when the broker's stop ended it: the lease is released too."""

    def demote(self, reason: str) -> None:
        """Stop acknowledging publishes now (synchronously), then close client connections
        and become a backup."""


class HaNode:
    """The HA state of one broker and the decision of one cycle."""

    def __init__(
        self,
        coordinator: Coordinator,
        hooks: HaHooks,
        *,
        name: str,
        address: str,
        loop_wait: float,
        demote_margin: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if demote_margin <= 0 or demote_margin >= coordinator.ttl:
            raise ValueError("demote_margin must be between 0 and the lease ttl")
        self.coordinator = coordinator
        self.hooks = hooks
        self.me = Leader(name, address)
        self.loop_wait = loop_wait
        self.demote_margin = demote_margin
        self.clock = clock
        self.role: Role = "backup"
        self.valid_until = 0.0
        """While primary: the lease is ours until this instant (monotonic), at least."""
        self.last: Decision | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._bootstrap_failed = False
        """This node claimed a new cluster's bootstrap but could not become primary: it tries again."""
        self._promotion_failed = False
        """Its last promotion failed: it publishes itself as no candidate, so it holds nobody back."""
        self.members: list[Member] = []
        """The members' records as last read (inspect shows them)."""
        self._previous_reason: str | None = None
        self._full_stop_since: float | None = None
        """When this node, not caught up, first found no primary in a row of cycles that let it take
        over after a full stop of the group (any other cycle ends the row): it waits up to ``ttl``
        from then for the others that may take over to start."""
        self._found_no_primary = False
        """The coordinator's last answer to this backup was that no node holds the lease (``promote``
        may ask then); False after a cycle that could not tell. Kept while a cycle is under way."""
        self._operator_takeover = False
        """``amqtt-durable promote`` asked this node to take the free lease at its next cycle."""
        self._unanswered_since: float | None = None
        self._followed: tuple[str, int] | None = None
        """The name and term of the primary whose history this node's store holds last: the leader
        it last followed (its backup end's IN_SYNC came from it, if any: ``follow`` forgets a
        caught-up state when the leader or its term changes)."""
        self._caught_up_earlier = False
        """This backup's last cycle without a primary found it caught up with an earlier primary,
        not the last one: it counts as not caught up (no candidate) until it follows a primary."""

    @property
    def caught_up_earlier(self) -> bool:
        """This backup's last cycle without a primary found it caught up with an earlier primary
        than the last one: it counts as not caught up (inspect says so) until it follows one."""
        return self._caught_up_earlier

    @property
    def ttl(self) -> float:
        return self.coordinator.ttl

    def deadline(self) -> float:
        """When a primary that cannot renew must have stopped acknowledging."""
        return self.valid_until - self.demote_margin

    def may_acknowledge(self) -> bool:
        """The acknowledging path asks this before each PUBACK/PUBREC."""
        return self.role == "primary" and self.clock() < self.deadline()

    async def run_cycle(self) -> Decision:
        decision = await (self._as_primary() if self.role == "primary" else self._as_backup())
        self.last = decision
        return decision

    # --- primary ------------------------------------------------------------------------------

    async def _as_primary(self) -> Decision:
        started = self.clock()
        left = self.deadline() - started
        if left <= 0:
            return self._demote("the lease could not be renewed before its end")
        try:
            async with asyncio.timeout(left):
                renewed = await self.coordinator.renew(self.me)
        except (CoordinatorError, TimeoutError) as exc:
            if self.role != "primary":  # the deadline's timer demoted this node meanwhile
                return Decision("demoted", f"demoted at the lease's deadline while renewing ({_why(exc)})", True)
            if self.clock() >= self.deadline():
                return self._demote(f"the lease could not be renewed before its end ({_why(exc)})", unanswered=True)
            return Decision(
                "retry",
                f"could not renew the leader lease ({_why(exc)}); it is ours for "
                f"{self.deadline() - self.clock():.1f} s more, still primary",
                True,
            )
        if self.role != "primary":  # demoted by the timer while the renewal was on its way: stays so
            return Decision("demoted", "demoted at the lease's deadline while renewing")
        if not renewed:
            return self._demote("the leader lease is gone (expired, or the key names another node)")
        self.valid_until = started + self.ttl
        self._arm_deadline()
        await self._publish_as_primary()
        safe = self.ttl - self.demote_margin
        return Decision("renewed", f"renewed the leader lease: primary for at least {safe:g} s")

    async def _publish_as_primary(self) -> None:
        """The primary's record, for inspect only (a primary holds no backup back): best effort,
        bounded so the next renewal is not delayed much."""
        try:
            async with asyncio.timeout(self.loop_wait / 2):
                await self.coordinator.publish_member(self.record())
                self.members = await self.coordinator.members()
        except (CoordinatorError, MemberNameTakenError, TimeoutError) as exc:  # the leader key decides
            log.debug("replication HA %s: could not publish this node's position: %s", self.me.name, _why(exc))

    def _demote(self, why: str, *, unanswered: bool = False) -> Decision:
        reason = f"{why}: demoted, no longer acknowledging; clients closed, rejoining as a backup"
        self.role = "backup"
        self._found_no_primary = False  # from before its term: promote waits for a backup cycle
        self.valid_until = 0.0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.hooks.demote(reason)
        return Decision("demoted", reason, unanswered)

    def _arm_deadline(self) -> None:
        """The demotion does not wait for a cycle: a timer fires at the deadline."""
        if self._deadline is not None:
            self._deadline.cancel()
        loop = asyncio.get_running_loop()
        delay = self.deadline() - self.clock()
        self._deadline = loop.call_at(loop.time() + max(0.0, delay), self._deadline_reached)

    def _deadline_reached(self) -> None:
        self._deadline = None
        if self.role == "primary" and self.clock() >= self.deadline():
            self.last = self._demote("the lease was not renewed in time")
            log.warning("replication HA %s: %s", self.me.name, self.last.reason)

    # --- backup -------------------------------------------------------------------------------

    def request_takeover(self) -> str | None:
        """``amqtt-durable promote`` on a node with a coordinator, the operator's decision: take the
        lease at the next cycle if it is still free, without the checks that this node holds
        every acknowledged publish (the lease is still taken atomically: no split brain). None:
        accepted; else why not: only a backup whose last cycle found no primary is promoted so."""
        if self.role == "primary":
            return "it is the primary already"
        if not self._found_no_primary:
            return (
                "its coordinator decides who is primary: a primary holds the lease (or this node's last HA cycle "
                "could not tell); promote takes the lease only while the coordinator has no primary"
            )
        self._operator_takeover = True
        log.warning(
            "replication HA %s: promoted by the operator: takes the leader lease at its next cycle if it is "
            "still free, whether or not it holds every acknowledged publish",
            self.me.name,
        )
        return None

    async def _as_backup(self) -> Decision:
        started = self.clock()
        waited_since, self._full_stop_since = self._full_stop_since, None  # kept only by a full stop's wait
        try:
            async with asyncio.timeout(self.ttl):  # the coordinator's calls only, not the promotion
                await self.coordinator.publish_member(self.record())
                leader = await self.coordinator.leader()
                self._found_no_primary = leader is None
                self.members = await self.coordinator.members()
                if leader is not None:
                    if self._operator_takeover:
                        self._operator_takeover = False
                        log.warning(
                            "replication HA %s: the operator's promote is void: %s took the leader lease first",
                            self.me.name,
                            leader.name,
                        )
                    return self._follow(leader)
                operator_asked = self._operator_takeover  # _without_primary uses it up
                chosen = await self._without_primary(waited_since)
                if isinstance(chosen, Decision):
                    return chosen
                action, why = chosen
                started = self.clock()
                if not await self.coordinator.acquire(self.me):
                    if operator_asked:
                        log.warning(
                            "replication HA %s: the operator's promote is void: another node took the leader "
                            "lease first (or took it and gave it up since this cycle found no primary)",
                            self.me.name,
                        )
                    return Decision(
                        "wait",
                        f"{why}, but another node took the lease first (or took it and gave it up since this "
                        "cycle found no primary: the next cycle decides on what it left)",
                    )
        except MemberNameTakenError as exc:
            self._found_no_primary = False
            self._void_takeover("this node's name is another broker's in the coordinator")
            return await self._name_taken(exc.holder)
        except (CoordinatorError, TimeoutError) as exc:
            self._found_no_primary = False
            self._void_takeover(f"the coordinator did not answer ({_why(exc)})")
            return Decision("wait", f"the coordinator does not answer ({_why(exc)}): staying a backup", True)
        return await self._promote_with_lease(started, action, why)

    def _void_takeover(self, why: str) -> None:
        """A cycle without the coordinator's answer voids an accepted ``promote`` (the operator runs
        it again): it never takes the lease cycles later, on a state nobody looked at."""
        if self._operator_takeover:
            self._operator_takeover = False
            log.warning("replication HA %s: the operator's promote is void: %s", self.me.name, why)

    async def _without_primary(self, waited_since: float | None) -> Decision | tuple[Action, str]:
        """Nobody holds the lease: whether this node takes it (the action and why) or waits
        (``waited_since``: ``_full_stop_since`` as the previous cycle left it)."""
        if self._operator_takeover:
            self._operator_takeover = False
            return "promoted", (
                "no primary, and the operator promoted this node (amqtt-durable promote): it may lack "
                "acknowledged publishes"
            )
        if self.hooks.caught_up() and await self._caught_up_with_last_primary():
            return await self._as_caught_up()
        if self._bootstrap_failed or await self.coordinator.initialize(self.me.name):
            return "bootstrapped", "a new cluster, claimed its bootstrap"
        waiting = await self._after_full_stop(waited_since)
        if waiting is not None:
            return waiting
        return "promoted", (
            "no primary after a full stop of the group, and this node holds every acknowledged "
            "publish (the last primary or in its synchronous set) and is the most advanced"
        )

    async def _caught_up_with_last_primary(self) -> bool:
        """Whether the primary this caught-up backup followed is the last one: the last node that
        took the lease, or the leader of the published synchronous set, each in the term it was
        recorded in (a node of that name in a later term may have served after another one this
        backup never followed: it took the lease again). Another node that took
        the lease since (while this one was frozen or cut off from the coordinator, so it never
        followed it) may have served: in async mode it deleted the synchronous set, and this node
        may lack what the earlier primary acknowledged without it in sync mode. Unless every such
        node's record says its promotion failed (it never served since it took the lease), this
        node counts as not caught up. A cluster of an earlier version names no former primary:
        caught up as before."""
        former = await self.coordinator.former_primaries()
        failed = {member.name for member in self.members if member.promotion_failed}
        self._caught_up_earlier = (
            bool(former)
            and not any(_same_term(self._followed, primary) for primary in former)
            and not {name for name, _ in former} <= failed
        )
        return not self._caught_up_earlier

    async def _as_caught_up(self) -> Decision | tuple[Action, str]:
        """No primary, and this node was caught up with the last one (Patroni's healthiest node)."""
        sync_set = await self.coordinator.sync_members()
        if sync_set is not None and self.me.name not in sync_set:
            return Decision(
                "wait",
                "no primary, but this node is not in the synchronous set the last primary published "
                f"({', '.join(sorted(sync_set)) or 'none'}): it may lack acknowledged publishes",
                waiting_for=tuple(sorted(sync_set)),
            )
        mine = self.record()
        ahead = ahead_of(mine, self.members, sync_set)
        if ahead:
            best = max(ahead, key=lambda member: member.seq)
            return Decision(
                "wait",
                f"no primary, but {best.name} is further ahead (batch {best.seq}, this node "
                f"{mine.seq}): leaving the lease to it",
                waiting_for=(best.name,),
            )
        return "promoted", "no primary, and this node is caught up and the most advanced"

    async def _after_full_stop(self, waited_since: float | None) -> Decision | None:
        """No primary, and no primary told this node IN_SYNC since it started: the whole group
        stopped (a power cut) or this node restarted while the primary was gone. None: it may
        take the lease (Patroni's rule after a full stop). Only a node that holds every
        acknowledged publish may: the last primary (it acknowledged them) or, when one was
        published, a member of its synchronous set (every acknowledgement waited for them), its
        store whole; and of those, only the most advanced one running (the last primary on a
        tie) whose last promotion did not fail, after waiting up to ``ttl`` (from
        ``waited_since``, else now) for those not running yet to start. A caught-up backup
        running that the caught-up rule lets take over (in the synchronous set, if one was
        published; else at least as far ahead as this node) means the group did not stop: it
        takes the lease, this node follows it."""
        former = frozenset(name for name, _ in await self.coordinator.former_primaries())
        sync_set = await self.coordinator.sync_members()
        eligible = former | (sync_set or frozenset())
        if self.me.name not in eligible:
            known = ", ".join(sorted(eligible))
            return Decision(
                "wait",
                "no primary, but this node is not caught up with the last one"
                + (
                    f", nor the last primary or in its synchronous set ({known}): it may lack acknowledged "
                    "publishes; not taking the lease until one of them is primary again"
                    if known
                    else ", and the coordinator names no former primary: not taking the lease"
                )
                + " (or the operator promotes a node: docs/replication.md, After a full stop of the group)",
                level=logging.WARNING,
                waiting_for=tuple(sorted(eligible)),
            )
        if not self.hooks.store_whole():
            return Decision(
                "wait",
                "no primary, and this node is not caught up with the last one: its store holds no whole "
                "replicated history (empty, or a snapshot half applied), so it is not taking the lease "
                "though its name is the last primary's or in its synchronous set",
                level=logging.WARNING,
            )
        store_id, seq = self.hooks.position()
        others = {member.name: member for member in self.members if member.name != self.me.name}
        follower = next(
            (
                member
                for member in others.values()
                if member.candidate
                and member.role == "backup"
                and member.store_id == store_id
                # In sync mode its set holds every acknowledged batch; in async mode only one at
                # least as far ahead takes nothing acknowledged away from this node.
                and (member.name in sync_set if sync_set is not None else member.seq >= seq)
            ),
            None,
        )
        if follower is not None:  # not a full stop: this node restarted while the primary was gone
            return Decision(
                "wait",
                f"no primary, and {follower.name} is a caught-up backup that takes the lease: this node "
                "rejoins as its backup",
                waiting_for=(follower.name,),
            )
        ahead = [
            member
            for member in others.values()
            if (member.name in eligible or (sync_set is None and member.candidate))
            and not member.promotion_failed
            and member.store_id == store_id
            and (member.seq > seq or (member.seq == seq and member.name in former and self.me.name not in former))
        ]
        if ahead:
            best = max(ahead, key=lambda member: member.seq)
            return Decision(
                "wait",
                f"no primary after a full stop of the group, and {best.name} holds every acknowledged publish "
                f"too and is further ahead or was primary last (batch {best.seq}, this node {seq}): leaving the "
                "lease to it",
                waiting_for=(best.name,),
            )
        now = self.clock()
        self._full_stop_since = now if waited_since is None else waited_since
        missing = sorted(eligible - others.keys() - {self.me.name})
        if missing and now - self._full_stop_since < self.ttl:
            return Decision(
                "wait",
                f"no primary after a full stop of the group: waiting up to {self.ttl:g} s for "
                f"{', '.join(missing)} (the last primary or in its synchronous set) to start, "
                "in case it is further ahead",
                waiting_for=tuple(missing),
            )
        return None

    async def _name_taken(self, holder: Member) -> Decision:
        """The coordinator's record under this node's name is another node's: this node takes no
        primary to follow and never takes over until it can publish its own (one name, one
        member). When the leader key holds this node's name, that is said instead (``_follow``)."""
        with contextlib.suppress(CoordinatorError, TimeoutError):
            async with asyncio.timeout(self.ttl):
                leader = await self.coordinator.leader()
            if leader is not None and leader.name == self.me.name:
                return self._follow(leader)  # a wait: never follows a leader of its own name
        return Decision(
            "wait",
            f"another broker publishes its position under this node's name, {self.me.name}, at "
            f"{holder.address} (this node is {self.me.address}): names must be unique in the "
            "cluster, give one of them another replication.name, or this node restarted at a new address: that "
            "record ends within lease_ttl; this node takes no primary to follow and never takes over until then",
            level=logging.ERROR,
        )

    async def _promote_with_lease(self, started: float, action: Action, why: str) -> Decision:
        """The lease taken (asked for at ``started``): become primary, or give it back. An operator's
        promote that arrived during this cycle is done with too (never a takeover later), and so is
        a full stop's wait (a later one begins anew)."""
        late_promote, self._operator_takeover = self._operator_takeover, False
        self._full_stop_since = None
        self.valid_until = started + self.ttl
        self.role = "primary"
        self._arm_deadline()
        try:
            await self.hooks.promote()
        except PromotionStoppedError:
            await self._give_back()
            return Decision("stopped", f"{why}, but the broker stops: the promotion ended, the lease is released")
        except Exception as exc:  # the store would not load, say: stay a backup, try again later
            self._bootstrap_failed = action == "bootstrapped"
            self._promotion_failed = True
            if late_promote:
                log.warning(
                    "replication HA %s: the operator's promote arrived while this node took the lease by itself; "
                    "that promotion failed: the promote is void (run it again)",
                    self.me.name,
                )
            return await self._promotion_failed_with(exc)
        self._bootstrap_failed = self._promotion_failed = False
        if self.role != "primary":  # the deadline's timer demoted this node while it was promoting
            return Decision("demoted", f"{why}, but the lease ended while the promotion was under way")
        return Decision(action, f"{why}: took the leader lease, now primary")

    async def _promotion_failed_with(self, exc: Exception) -> Decision:
        """The promotion failed after the lease was taken: give the lease back at once (another
        caught-up node may take it) and stay a backup; the next cycles try again."""
        log.error(
            "replication HA %s: the promotion failed: %s. Released the leader lease; staying a backup "
            "and trying again in the next cycles",
            self.me.name,
            exc,
        )
        await self._give_back()
        return Decision("wait", f"the promotion failed ({exc}): released the lease, still a backup")

    async def _give_back(self) -> None:
        """A promotion that did not make this node primary: a backup again, the lease released."""
        self.role = "backup"
        self.valid_until = 0.0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        with contextlib.suppress(CoordinatorError, TimeoutError):
            async with asyncio.timeout(self.demote_margin):
                await self.coordinator.release(self.me)

    def _follow(self, leader: Leader) -> Decision:
        if leader.name == self.me.name:
            if leader.address != self.me.address:
                return Decision(
                    "wait",
                    f"another broker holds the leader lease under this node's name, {self.me.name}, at "
                    f"{leader.address} (this node is {self.me.address}): names must be unique in the cluster, "
                    "give one of them another replication.name (if this node's address changed since it held "
                    "the lease, wait for the lease to end)",
                    level=logging.ERROR,
                )
            return Decision("wait", "the lease still names this node from before it restarted: waiting for it to end")
        self._promotion_failed = self._bootstrap_failed = False  # another node is primary: a new term
        self._followed, self._caught_up_earlier = (leader.name, leader.term), False
        self.hooks.follow(leader)
        return Decision("follow", f"following primary {leader.name} at {leader.address}")

    def record(self) -> Member:
        """What this node publishes about itself now."""
        store_id, seq = self.hooks.position()
        candidate = (
            self.role == "backup"
            and self.hooks.caught_up()
            and not self._promotion_failed
            and not self._caught_up_earlier
        )
        return Member(self.me.name, self.role, store_id, seq, candidate, self.me.address, self._promotion_failed)

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, on_decision: Callable[[Decision], None] | None = None) -> None:
        """Cycle every ``loop_wait`` seconds until ``stop``; a primary releases the lease on the way out."""
        try:
            while not stop.is_set():
                decision = await self.run_cycle()
                self._log(decision)
                if on_decision is not None:
                    on_decision(decision)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.loop_wait):
                        await stop.wait()
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
            if self.role == "primary":
                self._demote("the broker stops")
                with contextlib.suppress(CoordinatorError, TimeoutError):
                    async with asyncio.timeout(self.demote_margin):
                        await self.coordinator.release(self.me)
            with contextlib.suppress(CoordinatorError, TimeoutError):
                async with asyncio.timeout(self.demote_margin):
                    await self.coordinator.withdraw_member()

    def _log(self, decision: Decision) -> None:
        """A tired operator reads these: a reason repeated from the previous cycle is DEBUG, and
        the coordinator not answering is one WARNING when it starts, one INFO when it ends."""
        level = decision.level or _LEVELS.get(decision.action, logging.INFO)
        if decision.unanswered:
            if self._unanswered_since is None:
                self._unanswered_since = self.clock()
                level = logging.WARNING
            elif decision.action != "demoted":  # a role change is never quiet
                level = logging.DEBUG
        else:
            if self._unanswered_since is not None:
                silent = self.clock() - self._unanswered_since
                self._unanswered_since = None
                log.info("replication HA %s: the coordinator answers again after %.1f s", self.me.name, silent)
            if decision.reason == self._previous_reason:
                level = logging.DEBUG
        self._previous_reason = decision.reason
        log.log(level, "replication HA %s: %s", self.me.name, decision.reason)


_LEVELS = {"renewed": logging.DEBUG, "follow": logging.DEBUG, "retry": logging.WARNING, "demoted": logging.WARNING}
"""The steady state is quiet; a primary in trouble is a WARNING."""


def ahead_of(me: Member, members: Iterable[Member], sync: frozenset[str] | None = None) -> list[Member]:
    """The live members that hold batches ``me`` lacks and could take over themselves: other
    candidates (caught-up backups whose promotion did not fail) of the same store, strictly
    further ahead and, in sync mode (``sync``: the published synchronous set), in that set.
    Empty: ``me`` is (one of) the most advanced and may take the lease. A member whose record
    expired is not in ``members``, so a stopped node holds nobody back."""
    return [
        member
        for member in members
        if member.name != me.name
        and member.candidate
        and member.role == "backup"
        and member.store_id == me.store_id
        and member.seq > me.seq
        and (sync is None or member.name in sync)
    ]


def _same_term(followed: tuple[str, int] | None, primary: tuple[str, int]) -> bool:
    """Whether the followed primary is ``primary`` in the same term: a name again in a later term
    (it died, another served, it took the lease once more) is another primary. A term of 0 (a
    record of an earlier version) is compared by name."""
    if followed is None or followed[0] != primary[0]:
        return False
    return followed[1] == primary[1] or 0 in (followed[1], primary[1])


def _why(exc: BaseException) -> str:
    return "no answer in time" if isinstance(exc, TimeoutError) else str(exc)
