"""The leader lease against a real etcd (Debian's etcd-server, started by the `etcd` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from replication_helpers import primary_store

from amqtt_durable.process import EtcdProcess, free_port
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader, Member
from amqtt_durable.replication.errors import CoordinatorError
from amqtt_durable.replication.etcd import EtcdCoordinator, _b64
from amqtt_durable.replication.ha import Decision, HaNode
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.position import position_op
from amqtt_durable.replication.primary import Primary

TTL = 2
BOUND = 30.0


def coordinator(etcd: EtcdProcess, ttl: float = TTL) -> EtcdCoordinator:
    return EtcdCoordinator([etcd.url], prefix="/amqtt-durable/test/", ttl=ttl, timeout=1.0)


def test_one_lease_holder_at_a_time_and_the_lease_ends_with_its_ttl(etcd: EtcdProcess) -> None:
    async def main() -> None:
        a, b = coordinator(etcd), coordinator(etcd)
        me, other = Leader("a", "127.0.0.1:1"), Leader("b", "127.0.0.1:2")
        assert await a.leader() is None
        assert await a.former_primaries() == frozenset()
        assert await a.acquire(me)
        first = await b.leader()
        assert first == me and first is not None and first.term == a.term > 0  # its key's create_revision
        assert await b.former_primaries() == frozenset({("a", a.term)})  # the last to take the lease, its term
        assert not await b.acquire(other)
        assert await a.renew(me)
        assert not await b.renew(other)  # b holds no lease
        assert await a.initialize("a")
        assert not await b.initialize("b")
        assert await b.sync_members() is None
        assert await a.publish_sync(me, frozenset({"b", "c"}))
        assert not await b.publish_sync(other, frozenset({"b"}))  # only the leader writes the set
        assert await b.sync_members() == frozenset({"b", "c"})
        await expired(b)  # a stopped renewing: etcd expires the lease by itself
        assert not await a.renew(me)
        assert await b.former_primaries() == frozenset({("a", a.term)})  # kept after the lease ended
        assert await b.acquire(other)
        assert b.term > a.term
        await b.release(other)
        assert await a.leader() is None
        # b took it last; a published the synchronous set last: both may hold acknowledged publishes
        assert await a.former_primaries() == frozenset({("a", a.term), ("b", b.term)})
        assert await a.acquire(me)  # a again, in a later term: another primary than a in its first one
        assert a.term > b.term and await b.former_primaries() == frozenset({("a", a.term), ("a", first.term)})
        await a.release(me)

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_members_publish_their_records_under_their_own_leases(etcd: EtcdProcess) -> None:
    async def main() -> None:
        a, b, reader = coordinator(etcd), coordinator(etcd), coordinator(etcd)
        assert await reader.members() == []
        await a.publish_member(Member("a", "primary", 9, 120, False))
        await b.publish_member(Member("b", "backup", 9, 100, True))
        await b.publish_member(Member("b", "backup", 9, 118, True))  # a cycle later: renewed and updated
        assert await reader.members() == [Member("a", "primary", 9, 120, False), Member("b", "backup", 9, 118, True)]
        assert await a.acquire(Leader("a", "127.0.0.1:1"))
        await a.withdraw_member()  # a clean stop: its record goes at once, its leader lease stays
        assert [m.name for m in await reader.members()] == ["b"]
        assert await reader.leader() is not None
        await gone(reader, "b")  # b stopped publishing: its record expires by itself with its lease
        await b.publish_member(Member("b", "backup", 9, 118, True))  # b resumes: a new lease, the record again
        assert [m.name for m in await reader.members()] == ["b"]
        failed = Member("b", "backup", 9, 118, False, "127.0.0.1:2", promotion_failed=True)
        await b.publish_member(failed)  # its promotion failed: said in its record
        assert await reader.members() == [failed]

    asyncio.run(asyncio.wait_for(main(), BOUND))


async def gone(etcd: EtcdCoordinator, name: str) -> None:
    """Ask etcd until ``name``'s record expired (as ``expired`` does for the lease)."""
    for _ in range(int(BOUND / 0.1)):
        if name not in [m.name for m in await etcd.members()]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the record of {name} did not expire")


def test_no_acquire_after_another_node_took_the_lease_and_gave_it_up_since_the_leader_was_read(
    etcd: EtcdProcess,
) -> None:
    """A node decides to take the lease on reads that found no leader; before its acquire, another node
    takes the lease (it may acknowledge publishes the first one lacks) and gives it back (a clean stop, a
    failed promotion). The acquire must fail: the decision rests on a state that is gone. Read again, the
    other node is the last primary, and the acquire succeeds."""

    async def main() -> None:
        c, q = coordinator(etcd), coordinator(etcd)
        me, other = Leader("c", "127.0.0.1:3"), Leader("q", "127.0.0.1:4")
        assert await c.leader() is None
        assert await c.former_primaries() == frozenset()  # what c decides on
        assert await q.leader() is None and await q.acquire(other)  # a whole term in between
        await q.release(other)
        assert not await c.acquire(me)
        assert await c.leader() is None  # c looks again: q is the last primary now
        assert await c.former_primaries() == frozenset({("q", q.term)})
        assert await c.acquire(me)
        assert (await q.leader()) == me
        await c.release(me)

    asyncio.run(asyncio.wait_for(main(), BOUND))


async def expired(etcd: EtcdCoordinator) -> None:
    """Ask etcd until nobody holds the lease (etcd has no event we could wait on through the
    gateway short of a watch stream; each check reads etcd's own state, bounded by the test)."""
    for _ in range(int(BOUND / 0.1)):
        if await etcd.leader() is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the lease did not expire")


def test_an_unreachable_etcd_is_a_coordinator_error() -> None:
    async def main() -> None:
        lost = EtcdCoordinator([f"http://127.0.0.1:{free_port()}"], prefix="/x", ttl=TTL, timeout=1.0)
        try:
            await lost.leader()
        except CoordinatorError as exc:
            assert "/v3/kv/range failed" in str(exc)
        else:
            raise AssertionError("no error from an etcd that is not there")

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_an_etcd_that_never_answers_is_an_error_within_the_call_timeout() -> None:
    async def main() -> None:
        held: list[asyncio.StreamWriter] = []

        async def black_hole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # accepts, reads nothing, answers nothing

        server = await asyncio.start_server(black_hole, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        silent = EtcdCoordinator([f"http://127.0.0.1:{port}"], prefix="/x", ttl=TTL, timeout=0.3)
        try:
            await silent.leader()
        except CoordinatorError as exc:
            assert "TimeoutError" in str(exc)
        else:
            raise AssertionError("no error from an etcd that never answers")
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), BOUND))


class Node:
    """Hooks of one HA node that record when it was promoted and demoted."""

    def __init__(self, *, caught_up: bool) -> None:
        self.is_caught_up = caught_up
        self.promoted = asyncio.Event()
        self.demoted = asyncio.Event()
        self.promoted_at = 0.0
        self.demoted_at = 0.0
        self.followed: list[Leader] = []
        self.following = asyncio.Event()
        self.decisions: list[Decision] = []

    def caught_up(self) -> bool:
        return self.is_caught_up

    def position(self) -> tuple[int, int]:
        return 1, 0

    def store_whole(self) -> bool:
        return False

    def follow(self, leader: Leader) -> None:
        self.followed.append(leader)
        self.following.set()

    async def promote(self) -> None:
        self.promoted_at = time.monotonic()
        self.promoted.set()

    def demote(self, reason: str) -> None:
        self.demoted_at = time.monotonic()
        self.demoted.set()


def test_a_partitioned_primary_demotes_itself_before_the_other_takes_the_lease(etcd: EtcdProcess) -> None:
    async def main() -> None:
        hooks_a, hooks_b = Node(caught_up=False), Node(caught_up=True)
        coord_a, coord_b = coordinator(etcd), coordinator(etcd)
        a = HaNode(coord_a, hooks_a, name="a", address="127.0.0.1:7001", loop_wait=0.2, demote_margin=0.5)
        b = HaNode(coord_b, hooks_b, name="b", address="127.0.0.1:7002", loop_wait=0.2, demote_margin=0.5)
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        run_a = asyncio.create_task(a.run(stop_a, hooks_a.decisions.append))
        await hooks_a.promoted.wait()  # a bootstraps the new cluster
        run_b = asyncio.create_task(b.run(stop_b, hooks_b.decisions.append))
        await hooks_b.following.wait()
        assert hooks_b.followed[-1] == Leader("a", "127.0.0.1:7001")
        assert b.role == "backup"
        lease_safe_until = a.valid_until  # a's lease cannot end before this (its clock)
        coord_a.endpoints = [f"http://127.0.0.1:{free_port()}"]  # a is cut off from etcd
        await hooks_b.promoted.wait()
        assert hooks_a.demoted.is_set()
        assert hooks_a.demoted_at < hooks_b.promoted_at  # never two primaries acknowledging
        assert hooks_a.demoted_at < lease_safe_until  # a stepped down before its lease could end
        assert a.role == "backup"
        assert not a.may_acknowledge()
        assert b.may_acknowledge()
        assert any(d.action == "retry" for d in hooks_a.decisions)
        assert hooks_b.decisions[-1].action == "promoted"
        assert await coord_b.leader() == Leader("b", "127.0.0.1:7002")
        stop_a.set()
        stop_b.set()
        await asyncio.gather(run_a, run_b)
        assert await coord_b.leader() is None  # b released the lease as it stopped

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_a_stop_while_a_lease_promotion_loads_the_store_ends_as_stopped(
    etcd: EtcdProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 119: the broker's stop begins while the promotion the lease started is loading the
    store (``on_promote`` under way). Before: once the load ended, the node logged "is primary
    from batch" and the HA loop recorded "bootstrapped ... now primary" for a broker that was
    stopping; only the loop's exit demoted it. Now: a "stopped" decision, the broker's work
    stopped as at a demotion, the lease released, nothing logged as primary."""
    caplog.set_level(logging.DEBUG, "amqtt_durable.replication")
    db, _ = primary_store(tmp_path / "b")
    db.put(*position_op(0, 0))
    loading, loaded = asyncio.Event(), asyncio.Event()
    served: list[Primary] = []
    work_stopped: list[str] = []

    async def load(primary: Primary) -> None:  # the broker's on_promote: loads until told
        served.append(primary)
        loading.set()
        await loaded.wait()

    async def main() -> None:
        config = ReplicationConfig(
            name="b",
            role="auto",
            listen=f"127.0.0.1:{free_port()}",
            coordinator=[etcd.url],
            cluster="stop-while-loading",
            lease_ttl=10,
            loop_wait=0.1,
            demote_margin=1.0,
        )
        coord = EtcdCoordinator([etcd.url], prefix=config.prefix, ttl=10, timeout=1.0)
        node = ReplicationNode(db, config, coordinator=coord, on_promote=load, on_demote=work_stopped.append)
        await node.start()
        await asyncio.wait_for(loading.wait(), BOUND)  # a new cluster: b claims it and loads
        reader = EtcdCoordinator([etcd.url], prefix=config.prefix, ttl=10, timeout=1.0)
        assert await reader.leader() == Leader("b", config.listen)
        stopping = asyncio.create_task(node.stop())
        await asyncio.wait_for(node._ha_stop.wait(), BOUND)  # stop() began
        loaded.set()  # the load ends after the stop began
        await asyncio.wait_for(stopping, BOUND)
        assert [decision.action for decision in node.decisions] == ["stopped"], node.decisions
        assert node.primary is None and node._serving is None
        assert work_stopped == ["the broker stops"]
        assert len(served) == 1
        assert await reader.leader() is None  # released at once (its TTL is 10 s)

    asyncio.run(asyncio.wait_for(main(), BOUND))
    db.close()
    messages = [record.getMessage() for record in caplog.records]
    claims = [m for m in messages if "now primary" in m or "is primary from" in m or "demoted" in m]
    assert claims == [], messages
    assert any("the broker stops: the promotion ended, the lease is released" in m for m in messages), messages


class WholeNode(Node):
    """A node restarted after a full stop: not caught up, its store whole at batch ``seq``."""

    def __init__(self, seq: int) -> None:
        super().__init__(caught_up=False)
        self.seq = seq

    def position(self) -> tuple[int, int]:
        return 1, self.seq

    def store_whole(self) -> bool:
        return True


class Said:
    """``HaNode.run``'s ``on_decision``: the first decision whose reason contains ``says``."""

    def __init__(self, says: str) -> None:
        self.says = says
        self.decision: Decision | None = None
        self.event = asyncio.Event()

    def __call__(self, decision: Decision) -> None:
        if self.decision is None and self.says in decision.reason:
            self.decision = decision
            self.event.set()

    async def wait(self) -> Decision:
        await asyncio.wait_for(self.event.wait(), BOUND)
        assert self.decision is not None
        return self.decision


def test_a_node_in_async_mode_removes_a_synchronous_set_left_from_sync_mode_once_promoted(etcd: EtcdProcess) -> None:
    """Review 236: a was primary in sync mode and published {b}; the group was switched to async
    mode; a took the lease again and acknowledged alone; full stop. b, far behind, started alone
    took the lease (the old set named it). docs/replication.md: in async mode only the last
    primary takes over. A node in async mode removes the set once promoted (its primary end does,
    here the hooks' promote), in a transaction comparing the leader key; taking the lease keeps
    it (review 246: a failed promotion had left no set)."""

    async def main() -> None:
        a = Leader("a", "127.0.0.1:7001")
        era = coordinator(etcd)
        assert await era.initialize("a")
        assert await era.acquire(a)
        assert await era.publish_sync(a, frozenset({"b"}))  # the sync-mode period
        await era.release(a)
        assert await era.acquire(a)  # sync mode again: the set stays until a publishes its own
        assert await era.sync_members() == frozenset({"b"})
        assert not await era.publish_sync(Leader("b", "127.0.0.1:7002"), None)  # only the leader deletes it
        assert await era.sync_members() == frozenset({"b"})
        await era.release(a)
        a_hooks = WholeNode(seq=100_000)
        a_ha = HaNode(coordinator(etcd), a_hooks, name="a", address=a.address, loop_wait=0.2, demote_margin=0.5)
        stop = asyncio.Event()
        runner = asyncio.create_task(a_ha.run(stop))
        await asyncio.wait_for(a_hooks.promoted.wait(), 3 * TTL)  # after waiting for b: the async period
        assert await era.sync_members() == frozenset({"b"}), "taking the lease keeps the set"
        assert await era.publish_sync(a, None)  # a's primary end, once promoted (node.py)
        assert await era.sync_members() is None and {name for name, _ in await era.former_primaries()} == {"a"}
        stop.set()
        await asyncio.wait_for(runner, BOUND)  # a full stop (a clean one here; a kill is the same)
        b_hooks = WholeNode(seq=5)
        b = HaNode(coordinator(etcd), b_hooks, name="b", address="127.0.0.1:7002", loop_wait=0.2, demote_margin=0.5)
        stop = asyncio.Event()
        said = Said("synchronous set (a): it may lack")
        runner = asyncio.create_task(b.run(stop, said))
        decision = await said.wait()
        assert decision.level == logging.WARNING and not b_hooks.promoted.is_set()
        stop.set()
        await asyncio.wait_for(runner, BOUND)
        assert await era.leader() is None

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_a_promote_is_accepted_whenever_the_nodes_cycles_find_no_primary(etcd: EtcdProcess) -> None:
    """Review 236: a PROMOTE to a waiting node (no primary, nothing changing) arriving while its
    cycle waited for etcd was refused ('could not tell'): 6.3% of them at random times."""

    async def main() -> tuple[int, list[str]]:
        former = coordinator(etcd)
        assert await former.initialize("a")
        assert await former.acquire(Leader("a", "127.0.0.1:7001"))  # the last primary: a
        await former.release(Leader("a", "127.0.0.1:7001"))
        c = HaNode(coordinator(etcd), Node(caught_up=False), name="c", address="127.0.0.1:7003",
                   loop_wait=0.05, demote_margin=0.5)  # fmt: skip
        stop = asyncio.Event()
        said = Said("nor the last primary")
        runner = asyncio.create_task(c.run(stop, said))
        await said.wait()
        refusals = []
        for trial in range(100):
            await asyncio.sleep(0.003 * (trial % 17))  # at spread points of the cycles
            refused = c.request_takeover()
            if refused is not None:
                refusals.append(refused)
            c._operator_takeover = False  # withdrawn before a cycle acts on it: c keeps waiting
        stop.set()
        await asyncio.wait_for(runner, BOUND)
        return len(refusals), refusals

    refused, why = asyncio.run(asyncio.wait_for(main(), BOUND))
    assert refused == 0, why[:3]


@pytest.mark.parametrize("value", [b"not json", b"[1]", b"[" * 100_000], ids=["text", "list", "nested"])
def test_a_record_this_version_cannot_read_is_a_coordinator_error_naming_its_key(
    value: bytes, etcd: EtcdProcess
) -> None:
    """A leader, primary or sync record that is not one (text, another JSON value, JSON nested past the
    interpreter's limit: RecursionError, which ended the HA loop as a ValueError did) is a CoordinatorError
    naming its key, which the HA loop takes as the coordinator not answering; such a member record counts
    as absent."""

    async def main() -> None:
        writer, reader = coordinator(etcd), coordinator(etcd)
        await writer.publish_member(Member("a", "backup", 9, 1, True))
        for name in ("leader", "primary", "sync", "members/b"):
            await writer._call("/v3/kv/put", {"key": _b64(writer.prefix + name), "value": _b64(value)})
        assert await reader.members() == [Member("a", "backup", 9, 1, True)]
        for read, key in (
            (reader.leader, "leader"),
            (reader.former_primaries, "primary"),
            (reader.sync_members, "sync"),
        ):
            with pytest.raises(CoordinatorError, match=f"{writer.prefix}{key} holds a malformed record"):
                await read()

    asyncio.run(asyncio.wait_for(main(), BOUND))


MALFORMED_SYNC = [
    b"{}",
    b'{"members": 5}',
    b'{"members": [[1]]}',
    b'{"leader": "a", "members": ["a"], "term": "x"}',
    b'{"leader": "a", "members": ["a"], "term": Infinity}',
    b'{"leader": "a", "members": ["a"], "term": 1e999}',
    b'{"leader": "a", "members": ["a"], "term": NaN}',
]
MALFORMED_MEMBER = [
    b'{"name": "c", "role": "backup", "store_id": 1, "batch": Infinity, "candidate": true}',
    b'{"name": "c", "role": "backup", "store_id": 1e999, "batch": 1, "candidate": true}',
    b'{"name": "c", "role": "backup", "store_id": 1, "batch": 1, "candidate": "yes"}',
    b'{"name": 5, "role": "backup", "store_id": 1, "batch": 1, "candidate": true}',
]


def test_a_record_of_malformed_fields_does_not_end_the_ha_loop(
    etcd: EtcdProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """replication.md: a sync record that is a JSON object with a field missing, of another type, or
    NaN/Infinity/1e999 (a KeyError, TypeError, ValueError or OverflowError ended the HA loop) counts as
    etcd not answering, logged naming the key and how to delete it; such a members/ record counts as
    absent (int(Infinity) escaped members())."""
    caplog.set_level(logging.WARNING, "amqtt_durable")

    async def cycles(key: str, value: bytes, done: Callable[[HaNode, Decision], bool]) -> None:
        writer = coordinator(etcd)
        await writer._call("/v3/kv/put", {"key": _b64(writer.prefix + key), "value": _b64(value)})
        hooks = Node(caught_up=False)
        node = HaNode(coordinator(etcd), hooks, name="b", address="127.0.0.1:7002", loop_wait=0.05, demote_margin=0.5)
        stop, seen = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(node.run(stop, lambda d: seen.set() if done(node, d) else None))
        finished, _ = await asyncio.wait({task, asyncio.create_task(seen.wait())}, timeout=BOUND / 4,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        assert task not in finished, (key, value, task.exception() if task.done() else None)
        assert seen.is_set(), (key, value, node.last)
        stop.set()
        await task
        await writer._call("/v3/kv/deleterange", {"key": _b64(writer.prefix + key)})

    async def main() -> None:
        first = coordinator(etcd)
        assert await first.initialize("a")  # b does not bootstrap: it reads former_primaries and sync
        key = f"{first.prefix}sync"
        for value in MALFORMED_SYNC:
            caplog.clear()
            await cycles("sync", value, lambda node, d: f"{key} holds a malformed record" in d.reason)
            said = f"{key} holds a malformed record ("
            assert any(said in r.getMessage() and f"etcdctl del {key}" in r.getMessage() for r in caplog.records), (
                value, [r.getMessage() for r in caplog.records],
            )  # fmt: skip
        for value in MALFORMED_MEMBER:  # b's cycles go on, c counts as absent
            await cycles("members/c", value, lambda node, d: node.members == [node.record()])

    asyncio.run(asyncio.wait_for(main(), BOUND))


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"ID": "x"}',
        b'{"ID": 1, "succeeded": true, "kvs": 5}',
        b'{"ID": 1, "header": 5}',
        b'{"ID": 1, "kvs": [{"key": "a", "value": "eA=="}]}',
    ],
    ids=["empty", "id-text", "kvs-number", "header-number", "key-not-base64"],
)
def test_an_etcd_reply_of_another_shape_is_a_coordinator_error_naming_the_address(body: bytes) -> None:
    """An endpoint answering HTTP 200 with a JSON object that is not etcd's reply (a KeyError 'ID',
    TypeError or ValueError where a field is read; binascii.Error decoding the key of a record that does
    not decode) is a CoordinatorError naming it, not the endpoint tried before it that did not answer:
    the HA loop goes on as when etcd does not answer."""

    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        fake = EtcdCoordinator([f"http://127.0.0.1:{free_port()}", url], prefix="/x", ttl=TTL, timeout=1.0)
        node = HaNode(fake, Node(caught_up=True), name="b", address="127.0.0.1:7002", loop_wait=0.05, demote_margin=0.5)
        stop, seen = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(node.run(stop, lambda d: seen.set() if f"coordinator {url}: " in d.reason else None))
        finished, _ = await asyncio.wait({task, asyncio.create_task(seen.wait())}, timeout=BOUND / 2,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        assert task not in finished, task.exception() if task.done() else None
        assert seen.is_set() and node.last.unanswered, node.last
        stop.set()
        await task
        if b'"kvs": [' in body:  # the record does not decode, nor its key: what etcd sent is shown
            with pytest.raises(CoordinatorError, match=f"coordinator {url}: 'a' holds a malformed record"):
                await fake.leader()
        else:  # read directly too: the HA cycle may stop at an earlier call
            with contextlib.suppress(CoordinatorError):
                assert await fake.leader() is None
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), BOUND))


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:99999"])
def test_a_leader_record_whose_address_is_not_host_port_does_not_end_the_ha_loop(
    address: str, etcd: EtcdProcess, tmp_path: Path
) -> None:
    """Review 325: a leader record of fields of the right types but an address that is not host:port (a
    ReplicationError when the node followed it ended the HA loop) is a malformed record naming its key:
    the node's cycles go on, as for any record of another shape."""

    async def main() -> None:
        listen, where = f"127.0.0.1:{free_port()}", [etcd.url]
        config = ReplicationConfig(name="b", role="auto", listen=listen, coordinator=where, cluster="leader-address",
                                   lease_ttl=10, loop_wait=0.05, demote_margin=1.0)  # fmt: skip
        writer = EtcdCoordinator(where, prefix=config.prefix, ttl=10, timeout=1.0)
        grant = await writer._call("/v3/lease/grant", {"TTL": 30})
        record = b'{"name": "z", "address": "%s"}' % address.encode()
        key = config.prefix + "leader"
        await writer._call("/v3/kv/put", {"key": _b64(key), "value": _b64(record), "lease": grant["ID"]})
        db, _ = primary_store(tmp_path / "b")
        db.put(*position_op(0, 0))
        reader = EtcdCoordinator(where, prefix=config.prefix, ttl=10, timeout=1.0)
        node = ReplicationNode(db, config, coordinator=reader)
        said, decided = Said(f"{key} holds a malformed record"), node._decided
        node._decided = lambda decision: (decided(decision), said(decision))  # type: ignore[method-assign]
        await node.start()
        try:
            decision = await said.wait()
            assert repr(address) in decision.reason and decision.unanswered, decision
            assert node._ha_task is not None and not node._ha_task.done(), node._ha_task
        finally:
            await node.stop()
            db.close()

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_records_an_earlier_release_wrote_are_read_with_their_defaults(etcd: EtcdProcess) -> None:
    """replication.md (rolling upgrade): a ``sync`` record without ``term`` is read (term 0: its leader matched
    by name only), a ``members/`` record without ``address`` or ``promotion_failed`` is read with "" and
    false, not counted as absent or as a malformed record; a node of any address takes such a record over."""

    async def main() -> None:
        writer, reader = coordinator(etcd), coordinator(etcd)
        old_sync = b'{"leader": "a", "members": ["a", "b"]}'
        old_member = b'{"name": "c", "role": "backup", "store_id": 9, "batch": 3, "candidate": true}'
        await writer._call("/v3/kv/put", {"key": _b64(writer.prefix + "sync"), "value": _b64(old_sync)})
        await writer._call("/v3/kv/put", {"key": _b64(writer.prefix + "members/c"), "value": _b64(old_member)})
        assert await reader.sync_members() == frozenset({"a", "b"})
        assert await reader.former_primaries() == frozenset({("a", 0)})
        assert await reader.members() == [Member("c", "backup", 9, 3, True, "", False)]
        now = Member("c", "backup", 9, 4, True, "127.0.0.1:5")  # c upgraded: its record says no address
        await writer.publish_member(now)
        assert await reader.members() == [now]

    asyncio.run(asyncio.wait_for(main(), BOUND))


def test_an_error_of_this_modules_own_code_is_not_taken_for_a_reply_of_another_shape(etcd: EtcdProcess) -> None:
    """Review 325: only the reading of etcd's replies is a CoordinatorError "answered no reply of etcd's
    shape"; a wrong call (a missing argument, a name that is not text) raises as it is, not hidden as etcd
    not answering."""

    async def main() -> None:
        etcd_coordinator = coordinator(etcd)
        with pytest.raises(TypeError, match="missing 1 required positional argument"):
            await etcd_coordinator.acquire()  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="can only concatenate str"):
            await etcd_coordinator.publish_member(Member(b"a", "backup", 1, 1, True))  # type: ignore[arg-type]

    asyncio.run(asyncio.wait_for(main(), BOUND))
