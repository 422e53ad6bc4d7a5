"""Role changes of a replicated broker, plain classes over real stores: a demotion's wind-down
comes before the backup end starts, a failed promotion leaves a backup that gives the lease
back, a new term as primary starts from a fresh engine state (nothing of the old term left
running, cumulative counters kept), the store reopened after a failed write is used by every
replication end, a halted committer keeps no callbacks, a publish on a broker that is not the
primary is neither stored nor acknowledged, and a clean stop waits for the backups' acks."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import plyvel
import pytest
from amqtt.adapters import StreamWriterAdapter
from amqtt.errors import MQTTError
from replication_helpers import bounded, commit, following, ops_for, primary_store
from test_replicated_commits import HeldShipping
from test_replication_ha import Clock, FakeCoordinator, Hooks, node

from amqtt_durable.amqtt_glue import AmqttHooks, DurableSessionsPlugin, InboundPublishes, OrderedAcks
from amqtt_durable.config import DurableConfig, StreamConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import DurableError, NotPrimaryError, StoreUnavailableError
from amqtt_durable.process import free_port
from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.commits import ReplicatedCommits
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader
from amqtt_durable.replication.framing import Frame, Hello, read_frame
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.position import position_op, read_position
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask
from amqtt_durable.store import GroupCommitter, open_store, read_store_id
from amqtt_durable.stream_log import TRIM_BUDGET, event_key
from recording_transport import RecordingTransport

HOST = "127.0.0.1"


class FakeLeader:
    """A primary's replication address that records the HELLO of each backup end connecting."""

    def __init__(self) -> None:
        self.hellos: asyncio.Queue[tuple[Hello, bool]] = asyncio.Queue()
        self.stopped: asyncio.Future[None] | None = None
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, HOST, 0)
        return f"{HOST}:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            kind, payload = await read_frame(reader)
            if kind == Frame.HELLO:
                stopped = self.stopped is not None and self.stopped.done()
                await self.hellos.put((Hello.decode(payload), stopped))
            await reader.read()  # until the backup end goes
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def test_a_demoted_node_follows_only_after_its_last_write_and_from_the_position_it_left(tmp_path: Path) -> None:
    """Finding 3: the old primary's last write (in the worker thread at the demotion) must be over
    before the backup end reads the store's position and applies the new primary's batches."""
    db, _ = primary_store(tmp_path / "a")

    async def main() -> None:
        leader = FakeLeader()
        address = await leader.start()
        config = ReplicationConfig(name="a", role="primary", listen=f"{HOST}:{free_port()}")

        async def last_write() -> None:  # what DurableEngine.stop_serving awaits: the write in flight
            await asyncio.get_running_loop().run_in_executor(None, db.put, *position_op(7, 77))

        def on_demote(reason: str) -> asyncio.Future[None]:
            leader.stopped = asyncio.ensure_future(last_write())
            return leader.stopped

        node = ReplicationNode(db, config, on_demote=on_demote)
        await node.start()  # a fixed-role primary
        assert node.primary is not None
        try:
            node.demote("a test demotion")
            node.follow(Leader("b", address))
            hello, stopped_first = await bounded(leader.hellos.get())
            assert stopped_first, "the backup end connected before the broker's last write was finished"
            assert (hello.seq, hello.crc) == (7, 77), "the backup end started from a position read too early"
        finally:
            await node.stop()
            await leader.close()

    asyncio.run(main())
    db.close()


def test_following_the_same_address_in_a_later_term_forgets_the_earlier_in_sync(tmp_path: Path) -> None:
    """Review 260 (ABA): the leader key names a again, at the same address, but in a later term (b
    served between a's two terms): an IN_SYNC from a's first term says nothing about its later one."""
    db, _ = primary_store(tmp_path / "c")

    async def main() -> None:
        leader = FakeLeader()
        address = await leader.start()
        node = ReplicationNode(db, ReplicationConfig(name="c", role="primary", listen=f"{HOST}:{free_port()}"))
        await node.start()
        try:
            node.demote("a test demotion")
            node.follow(Leader("a", address, 1))
            await bounded(leader.hellos.get())
            node.backup.caught_up = True  # a's first term said IN_SYNC
            node.follow(Leader("a", address, 1))  # the same term: nothing changes
            assert node.caught_up() and leader.hellos.empty()
            node.follow(Leader("a", address, 3))  # a took the lease again since
            assert not node.caught_up()
            await bounded(leader.hellos.get())  # a new backup end asks the new term
        finally:
            await node.stop()
            await leader.close()

    asyncio.run(main())
    db.close()


def test_a_promotion_whose_load_fails_gives_the_lease_back_and_tries_again() -> None:
    """Finding 7: a failing promotion must not end the HA loop nor keep the lease."""

    class FailingHooks(Hooks):
        async def promote(self) -> None:
            self.promoted += 1
            raise OSError("the store would not load")

    async def main() -> None:
        clock = Clock()
        fake = FakeCoordinator(clock)
        fake.initialized_by = "someone else"
        hooks = FailingHooks(caught_up=True)
        ha = node(fake, hooks)
        first = await ha.run_cycle()
        assert first.action == "wait" and "the promotion failed (the store would not load)" in first.reason
        assert ha.role == "backup" and not ha.may_acknowledge()
        assert fake.holder is None, "the lease was not given back"
        second = await ha.run_cycle()
        assert hooks.promoted == 2 and second.action == "wait", "the next cycle did not try again"
        hooks_ok = Hooks(caught_up=True)
        ha.hooks = hooks_ok
        assert (await ha.run_cycle()).action == "promoted" and ha.role == "primary"

    asyncio.run(bounded(main()))


def test_a_node_whose_promotion_fails_stays_a_backup_that_answers_tools(tmp_path: Path) -> None:
    db, _ = primary_store(tmp_path / "b")

    async def main() -> None:
        listen, unreachable = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
        config = ReplicationConfig(name="b", role="backup", primary=unreachable, listen=listen)

        def on_promote(primary: Primary) -> None:
            raise OSError("the store would not load")

        replication = ReplicationNode(db, config, on_promote=on_promote)
        await replication.start()
        try:
            with pytest.raises(OSError, match="would not load"):
                await replication.promote()
            assert replication.primary is None and not replication.may_acknowledge()
            status = await ask(config.listen, Frame.STATUS)
            assert status["role"] == "backup"
        finally:
            await replication.stop()

    asyncio.run(main())
    db.close()


def test_a_new_term_starts_from_a_fresh_state_with_nothing_of_the_old_one_running(tmp_path: Path) -> None:
    """Finding 6: a re-promotion reloads in place; the old term's timers, trim task and pumps must
    be gone, a late detach of an old connection must change nothing, counters must not go back."""
    config = DurableConfig(store=str(tmp_path / "store"), streams=[StreamConfig("log/#", max_age=3600.0)])

    async def main() -> None:
        engine = DurableEngine(config)
        engine.open()
        engine.start_timers()
        old_transport = RecordingTransport()
        await engine.connect("dev", clean_session=False, transport=old_transport)
        await engine.subscribe("dev", "t/#", 1, [])
        await engine.attach("dev", old_transport)
        stored = engine.route_publish("t/a", b"one", 1)
        assert stored is not None
        await stored
        await old_transport.wait_for(lambda sent: len(sent) == 1)
        old_session, old_pump = engine.sessions["dev"], engine.sessions["dev"].pump
        old_trim = engine._trim_task
        old_expiry = engine._expiry_timer
        assert old_pump is not None and old_trim is not None
        enqueued = engine.enqueued_total
        commits = engine.metrics()["store/commits"]
        assert commits > 0

        await engine.serve()  # a new term as primary, without a demotion in between

        assert old_trim.done(), "the old term's stream trim task still runs"
        assert old_expiry is None or old_expiry.cancelled()
        assert old_pump._stopped, "the old term's pump still runs"
        assert engine.sessions["dev"] is not old_session
        assert engine.enqueued_total == enqueued, "a cumulative counter went back"
        assert engine.metrics()["store/commits"] >= commits, "the commit count went back"
        await engine.detach("dev", old_transport)  # the old connection's end, late
        assert engine.sessions["dev"].record.expires_at is not None
        engine.start_timers()
        stored = engine.route_publish("t/a", b"two", 1)
        assert stored is not None
        await stored
        assert engine.enqueued_total == enqueued + 1
        await engine.close()

    asyncio.run(bounded(main()))


def test_every_replication_end_uses_the_store_reopened_after_a_failed_write(tmp_path: Path) -> None:
    """on_store_reopened -> ReplicationNode.use_db: a backup connecting later gets its snapshot
    from the new handle (the old one is closed)."""
    path = str(tmp_path / "primary")

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open_store()
        config = ReplicationConfig(name="p", role="primary", listen=f"{HOST}:{free_port()}")
        replication: ReplicationNode

        def on_promote(primary: Primary) -> None:
            engine.load(ReplicatedCommits(primary, "sync", replication.may_acknowledge))

        replication = ReplicationNode(engine.db, config, on_promote=on_promote)
        engine.on_store_reopened = replication.use_db
        await replication.start()
        try:
            await engine.connect("dev", clean_session=False)
            old = engine.db
            engine._reopen_store()  # what the committer does before retrying a failed write
            assert old.closed and replication.db is engine.db and replication.backup.db is engine.db
            assert replication.primary is not None and replication.primary.db is engine.db
            backup_db = open_store(str(tmp_path / "backup"))
            backup = Backup(backup_db, name="b", sync=False)
            async with following(backup, replication.primary.port):
                await bounded(backup.in_sync_event.wait())
            assert backup_db.get(b"sdev") is not None, "the snapshot lacks the session"
            backup_db.close()
        finally:
            await replication.stop()
            await engine.close()

    asyncio.run(main())


def test_a_halted_committer_keeps_no_callbacks(db: Any) -> None:
    async def main() -> None:
        committer = GroupCommitter(db, sync=False, batch_size=10, batch_delay_ms=0.0, pending_threshold=1)
        committer.halt("demoted")
        ran: list[int] = []
        for n in range(1000):
            with pytest.raises(NotPrimaryError):
                await committer.commit(lambda n=n: ran.append(n))
        assert committer._after_commit == [] and ran == []

    asyncio.run(main())


class NotServing:
    """The engine of a broker that is not (or no longer) the primary, as the publish path sees it."""

    serving = False

    def route_publish(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("routed on a broker that is not the primary")


class EndingTransport(RecordingTransport):
    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    async def fail(self) -> None:  # review 307 (3): not ``end``, which is a take-over
        self.ended.set()


@pytest.mark.parametrize("qos", [1, 0])
def test_a_publish_on_a_broker_that_is_not_the_primary_is_not_acknowledged(qos: int) -> None:
    """Finding 4: a connection accepted before the demotion (or a websocket one) publishes after it."""

    async def main() -> None:
        transport = EndingTransport()
        acks = OrderedAcks(transport, "publisher")  # type: ignore[arg-type]
        wanted: list[str] = []
        publishes = InboundPublishes(NotServing(), object(), acks, object(), wanted.append)  # type: ignore[arg-type]
        acks.add(None, 1)  # a PUBACK due from before the demotion still goes out
        publishes.route("t/a", b"late", qos, 2 if qos else None, retain=False, targets=None)
        publishes.hand_over("t/a", b"late", qos, 3 if qos else None, retain=False, stored=None)
        if qos:
            await bounded(transport.ended.wait())
        assert [(p.packet_type, p.packet_id) for p in transport.packets] == [(4, 1)], "acknowledged"
        assert wanted == [], "handed to amqtt's own delivery"

    asyncio.run(main())


def test_a_clean_stop_waits_until_the_backups_have_every_batch(tmp_path: Path) -> None:
    """Finding 5's replication half: Primary.wait_shipped returns once each in-sync backup has all."""
    db, store_id = primary_store(tmp_path / "p")

    async def main() -> None:
        primary = Primary(db, store_id=store_id, log_max_batches=1000, log_max_bytes=1 << 24)
        await primary.start(HOST, 0)
        backup_db = open_store(str(tmp_path / "b"))
        backup = Backup(backup_db, name="b", sync=False)
        try:
            async with following(backup, primary.port):
                await bounded(backup.in_sync_event.wait())
                for n in range(1, 201):
                    commit(primary, ops_for(n))  # async mode: nobody waits for these
                await bounded(primary.wait_shipped(within=30.0))
                assert backup.applied_seq == primary.log.head_seq == 200
                assert read_position(backup_db) == read_position(db)
        finally:
            await primary.close()
            backup_db.close()

    asyncio.run(main())
    db.close()


class AbortedTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_a_completion_refused_as_the_lease_ends_leaves_the_demotion_its_work(tmp_path: Path) -> None:
    """Finding 1: a sync commit completed after the lease's deadline but before the demotion fails
    its own publishes only; the demotion that follows must still end every client connection
    (it once found the committer halted already and did nothing)."""
    config = DurableConfig(store=str(tmp_path / "store"))
    first_run = DurableEngine(config)  # a store with its marks written: the load below writes nothing,
    first_run.open()  # so the test's own commit is the first batch shipped
    asyncio.run(first_run.close())
    engine = DurableEngine(config)
    engine.open_store()

    async def main() -> None:
        primary = Primary(engine.db, store_id=engine_store_id(engine), log_max_batches=100, log_max_bytes=1 << 20)
        shipping = HeldShipping(primary)
        engine.load(shipping)
        connection = AbortedTransport()
        writer = StreamWriterAdapter(SimpleNamespace(transport=connection))  # type: ignore[arg-type]
        sessions = {"dev": (None, SimpleNamespace(writer=writer))}
        plugin = SimpleNamespace(engine=engine, broker=SimpleNamespace(_sessions=sessions), _tasks=set())
        try:
            engine.committer.put(b"k", b"v")
            stored = engine.committer.commit()
            await bounded(shipping.shipping.wait())
            shipping.acknowledging = False  # the deadline passed; the demotion's timer has not run yet
            shipping.shipped[0].set_result(None)
            with pytest.raises(NotPrimaryError):
                await bounded(stored)
            stopping = DurableSessionsPlugin._demoted(plugin, "the lease was not renewed in time")  # type: ignore[arg-type]
            assert connection.aborted and writer.is_closed, "the demotion left a client connected"
            assert stopping is not None
            await bounded(stopping)
            assert engine.committer.halted is not None and not engine.serving
        finally:
            await primary.close()
            await engine.close()

    asyncio.run(main())


def engine_store_id(engine: DurableEngine) -> int:
    store_id = read_store_id(engine.db)
    assert store_id is not None
    return store_id


def test_a_load_after_a_failed_one_keeps_nothing_the_failed_one_read(tmp_path: Path) -> None:
    """Review (helper-32): a promotion's load that fails on a damaged record had read the sessions
    before it; the next load (after following another primary, whose batches deleted them) kept
    them: a ghost session with subscriptions, written back to the store by its next record."""
    config = DurableConfig(store=str(tmp_path / "store"))

    async def make_session() -> None:
        engine = DurableEngine(config)
        engine.open()
        await engine.connect("aaa-gone", clean_session=False)
        await engine.subscribe("aaa-gone", "t/#", 1)
        await engine.close()

    asyncio.run(bounded(make_session()))
    db = open_store(config.store, create=False)
    db.put(b"szzz-broken", b"\xff not a session record")  # read after the good one
    db.close()

    async def main() -> None:
        engine = DurableEngine(config)
        engine.open_store()  # a backup: the store open, the engine not loaded
        with pytest.raises(DurableError):
            engine.load()  # the promotion's load fails on the damaged record
        engine.open_store()  # following the new primary, whose batches delete both sessions
        engine.db.delete(b"saaa-gone")
        engine.db.delete(b"szzz-broken")
        engine.load()  # the next promotion
        assert "aaa-gone" not in engine.sessions, "a session deleted from the store came back"
        assert engine.index.route("t/x") == {}
        await engine.close()

    asyncio.run(bounded(main()))


def test_a_subscribe_or_unsubscribe_a_demotion_overtakes_is_refused_not_acknowledged(tmp_path: Path) -> None:
    """Review (helper-32): the subscription's commit fails once the committer is halted; SUBACK
    carries the failure code, and an UNSUBSCRIBE ends the connection without UNSUBACK (the
    NotPrimaryError reached amqtt's connection task as an unhandled exception)."""
    engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
    engine.open()

    async def allowed(*_: Any) -> bool:
        return True

    async def main() -> None:
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "kept/#", 1)
        broker = SimpleNamespace(
            **dict.fromkeys(("_authenticate", "_client_connected", "_initialize_client_session",
                             "_client_message_loop", "add_subscription", "_handle_subscription",
                             "_handle_unsubscription", "_handle_disconnect", "_handle_message_delivery",
                             "_delete_session", "_del_subscription", "_publish_retained_messages_for_subscription",
                             "_broadcast_message", "_cleanup_session", "shutdown", "_create_server_instance")),
            _topic_filtering=allowed, config={}, retained_messages={},
            plugins_manager=SimpleNamespace(_topic_plugins=[]),
        )  # fmt: skip
        hooks = AmqttHooks(broker, engine)
        session = SimpleNamespace(client_id="dev")
        connection = AbortedTransport()
        writer = StreamWriterAdapter(SimpleNamespace(transport=connection))  # type: ignore[arg-type]
        acknowledged: list[int] = []
        subacks: list[tuple[int, list[int]]] = []

        async def unsuback(packet_id: int) -> None:
            acknowledged.append(packet_id)

        async def suback(packet_id: int, codes: list[int]) -> None:
            subacks.append((packet_id, codes))

        handler = SimpleNamespace(
            writer=writer, mqtt_acknowledge_unsubscription=unsuback, mqtt_acknowledge_subscription=suback
        )
        loop = asyncio.get_running_loop()
        subscribed, unsubscribed = loop.create_future(), loop.create_future()
        subscribed.set_result(SimpleNamespace(topics=[("new/#", 1), ("other/#", 0)], packet_id=4))
        unsubscribed.set_result(SimpleNamespace(topics=["kept/#"], packet_id=5))
        engine.committer.halt("demoted")
        await hooks.handle_subscription(session, handler, subscribed)
        assert subacks == [(4, [0x80, 0x80])]
        with pytest.raises(MQTTError, match="UNSUBSCRIBE kept/# not stored"):
            await hooks.handle_unsubscription(session, handler, unsubscribed)
        assert acknowledged == [] and connection.aborted

    try:
        asyncio.run(bounded(main()))
    finally:
        asyncio.run(engine.close())


def test_a_clean_stop_whose_last_write_fails_still_ends_replication_and_closes_the_store(tmp_path: Path) -> None:
    """Review (helper-32): the last write of a primary's clean stop failing (a full disk) left its
    HA loop renewing the lease until the process ended, so no backup could take over sooner."""
    engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
    engine.open()
    ended: list[str] = []

    async def failing_write() -> None:
        raise StoreUnavailableError("No space left on device")

    async def stop_replication() -> None:
        ended.append("replication stopped")

    async def drain() -> None:
        ended.append("drained")

    engine.finish_writes = failing_write  # type: ignore[method-assign]
    replication = SimpleNamespace(stop=stop_replication, drain=drain)
    plugin = SimpleNamespace(_metrics_task=None, replication=replication, engine=engine)
    with pytest.raises(StoreUnavailableError):
        asyncio.run(bounded(DurableSessionsPlugin.close(plugin)))  # type: ignore[arg-type]
    assert ended == ["replication stopped"]
    assert engine.committer.halted is not None and engine.db.closed


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (OSError("the store would not load"), "replication start: OSError('the store would not load')"),
        (TimeoutError(), "replication start: TimeoutError()"),
        (plyvel.CorruptionError("Corruption: block checksum mismatch"),
         "replication start: CorruptionError('Corruption: block checksum mismatch')"),
        (None, f"replication.listen {{listen}}: [Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"),
    ],
)
def test_a_fixed_primary_s_start_failure_is_reported_as_what_failed(
    tmp_path: Path, failure: BaseException | None, reason: str
) -> None:
    """Review 88: the plugin's post-start took every OSError of the replication's start for its
    listen address (a store error in a fixed primary's promotion read "replication.listen ADDR:
    the store would not load", a TimeoutError gave an empty reason), and an error neither an
    OSError nor a DurableError (LevelDB's CorruptionError) went unread: the broker stayed up.
    Now only the two listeners' bind failures name replication.listen; anything else is itself
    (the broker's own load raising stands in for the engine's, ``failure``; None: the address is
    in use)."""
    engine: DurableEngine | None = None

    async def main() -> None:
        nonlocal engine
        with socket.socket() as holder:
            holder.bind((HOST, 0))
            holder.listen()
            listen = f"{HOST}:{holder.getsockname()[1] if failure is None else free_port()}"
            config = DurableConfig.from_mapping({
                "store": str(tmp_path / "store"), "metrics_interval": 0,
                "replication": {"name": "a", "role": "primary", "listen": listen},
            })
            engine = DurableEngine(config)
            engine.open_store()

            def promoted(primary: Primary) -> None:
                assert failure is not None
                raise failure

            plugin = SimpleNamespace(
                engine=engine, config=config, replication=None, start_failure=None, _metrics_task=None,
                _promoted=promoted, _demoted=lambda reason: None,
            )
            plugin._start_failed = functools.partial(DurableSessionsPlugin._start_failed, plugin)  # type: ignore[arg-type]
            await DurableSessionsPlugin.on_broker_post_start(plugin)  # type: ignore[arg-type]
            assert plugin.replication is not None and plugin.replication.primary is None
            await plugin.replication.stop()
            assert plugin.start_failure == reason.format(listen=listen)

    try:
        asyncio.run(bounded(main()))
    finally:
        if engine is not None:
            asyncio.run(engine.close())


def test_a_secret_file_gone_before_the_replication_starts_is_reported(tmp_path: Path) -> None:
    """Review 90: the replication node, which reads the secret (file or variable) and the TLS files,
    was built before the try that reports start failures: a secret file removed between the config's
    check and the post-start raised out of amqtt's post-start task, unread, and the broker stayed up."""
    engine: DurableEngine | None = None
    secret = tmp_path / "secret"

    async def main() -> None:
        nonlocal engine
        secret.write_text("s" * 32)
        config = DurableConfig.from_mapping({
            "store": str(tmp_path / "store"), "metrics_interval": 0,
            "replication": {"name": "a", "role": "primary", "listen": f"{HOST}:{free_port()}",
                            "secret_file": str(secret)},
        })
        secret.unlink()
        engine = DurableEngine(config)
        engine.open_store()
        plugin = SimpleNamespace(
            engine=engine, config=config, replication=None, start_failure=None, _metrics_task=None,
            _promoted=lambda primary: None, _demoted=lambda reason: None,
        )
        plugin._start_failed = functools.partial(DurableSessionsPlugin._start_failed, plugin)  # type: ignore[arg-type]
        await DurableSessionsPlugin.on_broker_post_start(plugin)  # type: ignore[arg-type]
        assert plugin.replication is None
        assert plugin.start_failure == (
            f"amqtt_durable config: 'replication.secret_file': cannot read the secret file {str(secret)!r}: "
            "No such file or directory"
        )

    try:
        asyncio.run(bounded(main()))
    finally:
        if engine is not None:
            asyncio.run(engine.close())


def lease_ends_now(replication: ReplicationNode) -> None:
    """What the deadline's timer does when the loop runs it with the lease's deadline reached."""
    ha = replication.ha
    if ha is not None and ha.role == "primary":
        ha.valid_until = ha.clock() + ha.demote_margin
        ha._deadline_reached()


class DemotedWhileClosingAdmin(ReplicationNode):
    """The lease's deadline passes during one of promote's awaits, before it sets ``primary``."""

    async def _close_admin(self) -> None:
        await super()._close_admin()
        if self._promoting:
            lease_ends_now(self)


@pytest.mark.parametrize("when", ["before the primary is set", "while the broker loads"])
def test_a_demotion_during_the_promotion_is_not_lost(tmp_path: Path, when: str) -> None:
    """Review (helper-32): node.demote found no primary yet, so the promotion went on; the broker
    then served while HA called the node a backup and the node never tried again. Either way the
    node ends a backup, answering on its replication address, with no primary end."""
    db, _ = primary_store(tmp_path / "a")
    db.put(*position_op(0, 0))

    async def main() -> None:
        clock = Clock()
        config = ReplicationConfig(name="a", role="auto", listen=f"{HOST}:{free_port()}",
                                   coordinator=["http://127.0.0.1:1"], lease_ttl=10, demote_margin=1.0)
        served: list[Primary] = []
        early = when == "before the primary is set"

        def on_promote(primary: Primary) -> None:
            served.append(primary)
            if not early:
                lease_ends_now(replication)

        kind = DemotedWhileClosingAdmin if early else ReplicationNode
        replication = kind(db, config, coordinator=FakeCoordinator(clock, ttl=10.0),
                           on_promote=on_promote, on_demote=lambda reason: None)
        assert replication.ha is not None
        replication.ha.clock = clock
        await replication._open_admin()
        try:
            decision = await bounded(replication.ha.run_cycle())
            assert decision.action == "demoted" and replication.ha.role == "backup"
            assert replication.primary is None
            assert len(served) == (0 if early else 1), "a node demoted before it served was made to serve"
            assert (await bounded(ask(config.listen, Frame.STATUS)))["role"] == "backup"
        finally:
            replication._ha_stop.set()
            await replication.stop()

    asyncio.run(main())
    db.close()


def stream_store(tmp_path: Path, events: int) -> dict[str, Any]:
    """A store whose stream log ``log/a`` holds ids 1..``events`` (written at max_count 100,000);
    returns the settings to reopen it with, replication a fixed primary."""
    settings: dict[str, Any] = {
        "store": str(tmp_path / "store"), "metrics_interval": 0,
        "streams": [{"filter": "log/#", "max_count": 100_000, "max_age": 0}],
    }

    async def fill() -> None:
        engine = DurableEngine(DurableConfig.from_mapping(settings))
        engine.open()
        for n in range(1, events + 1):
            assert engine.streams.append("log/a", b"e%d" % n, 1, 1000.0 + n) == n
        await bounded(engine.committer.commit())
        await engine.close()

    asyncio.run(bounded(fill()))
    settings["replication"] = {"name": "a", "role": "primary", "listen": f"{HOST}:{free_port()}"}
    return settings


def broker_plugin(engine: DurableEngine, config: DurableConfig) -> SimpleNamespace:
    """A DurableSessionsPlugin without amqtt: its own post-start, promotion and demotion."""
    plugin = SimpleNamespace(
        engine=engine, config=config, replication=None, start_failure=None, _metrics_task=None,
        broker=SimpleNamespace(_sessions={}, retained_messages={}), _tasks=set(),
    )
    for hook in ("_promoted", "_demoted", "_start_failed", "_fill_retained"):
        setattr(plugin, hook, functools.partial(getattr(DurableSessionsPlugin, hook), plugin))
    return plugin


def test_a_promotion_runs_the_stream_retention_pass_without_a_publish(tmp_path: Path) -> None:
    """Review (blindR P2-1): a broker that becomes the primary (here a fixed-role one, at its
    post-start) trims a log past a lowered max_count at once: _promoted serves, then starts the
    timers, whose first pass removes the excess (nothing publishes)."""
    settings = stream_store(tmp_path, 30)
    settings["streams"][0]["max_count"] = 5
    config = DurableConfig.from_mapping(settings)
    engine = DurableEngine(config)
    engine.open_store()  # a replicated broker's start: loaded only by the promotion

    async def main() -> None:
        plugin = broker_plugin(engine, config)
        await DurableSessionsPlugin.on_broker_post_start(plugin)  # type: ignore[arg-type]
        assert plugin.start_failure is None and plugin.replication is not None
        try:
            assert plugin.replication.primary is not None and engine.serving
            assert engine._trim_task is not None, "the promotion started no retention pass"
            await bounded(engine._trim_task)
            await bounded(engine.written_so_far())
            assert engine.streams.bounds("log/a") == (26, 30)
            assert engine.db.get(event_key("log/a", 25)) is None and engine.db.get(event_key("log/a", 26))
        finally:
            await plugin.replication.stop()
            await engine.close()

    asyncio.run(bounded(main()))


def test_the_retention_pass_s_deletes_reach_a_backup_in_sync(tmp_path: Path) -> None:
    """The start pass's chunks are commits like any other: a backup following the primary when the
    timers start loses what the primary trimmed, and keeps what it kept."""
    settings = stream_store(tmp_path, 30)
    settings["streams"][0]["max_count"] = 5
    config = DurableConfig.from_mapping(settings)
    assert config.replication is not None
    engine = DurableEngine(config)
    engine.open_store()

    async def main() -> None:
        replication: ReplicationNode

        async def on_promote(primary: Primary) -> None:  # _promoted's serve; its start_timers comes below
            await engine.serve(ReplicatedCommits(primary, "sync", replication.may_acknowledge))

        replication = ReplicationNode(engine.db, config.replication, on_promote=on_promote)
        await replication.start()
        backup_db = open_store(str(tmp_path / "backup"))
        try:
            assert replication.primary is not None
            backup = Backup(backup_db, name="b", sync=False)
            async with following(backup, replication.primary.port):
                await bounded(backup.in_sync_event.wait())
                assert backup_db.get(event_key("log/a", 25)) is not None, "the snapshot came after the pass"
                engine.start_timers()
                assert engine._trim_task is not None
                await bounded(engine._trim_task)
                await bounded(engine.written_so_far())  # sync mode: the backup has it too
                assert backup_db.get(event_key("log/a", 25)) is None, "the backup kept a trimmed event"
                assert backup_db.get(event_key("log/a", 26)) is not None
        finally:
            await replication.stop()
            await engine.close()
            backup_db.close()

    asyncio.run(bounded(main()))


def test_a_demotion_during_the_retention_pass_ends_it_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review (blindR P3-1): the pass's chunk commit fails with NotPrimaryError once the demotion
    halts the committer; that logged "stream retention failed" at ERROR with a traceback, for a
    broker that only stopped being the primary. The demotion comes in the loop pass after the
    first chunk was taken (10,000 deletes of the 24,999 due), its commit asked, not written."""
    settings = stream_store(tmp_path, 25_000)
    del settings["replication"]
    settings["streams"][0]["max_count"] = 1
    config = DurableConfig.from_mapping(settings)
    engine = DurableEngine(config)
    engine.open()

    async def main() -> None:
        plugin = broker_plugin(engine, config)
        loop = asyncio.get_running_loop()
        stopping: asyncio.Future[asyncio.Task[None] | None] = loop.create_future()
        engine.start_timers()  # the pass's first step (a chunk, its commit asked) runs next
        task = engine._trim_task
        assert task is not None
        loop.call_soon(lambda: stopping.set_result(DurableSessionsPlugin._demoted(plugin, "a test demotion")))  # type: ignore[arg-type]
        demotion = await bounded(stopping)
        assert demotion is not None
        await bounded(demotion)
        assert engine.streams.first_kept("log/a") == TRIM_BUDGET + 1, "the demotion did not come mid-pass"
        assert engine.db.get(event_key("log/a", 1)) is not None, "the chunk was written before the demotion"
        assert task.done() and not task.cancelled() and task.exception() is None

    with caplog.at_level("INFO", logger="amqtt_durable"):
        try:
            asyncio.run(bounded(main()))
        finally:
            asyncio.run(engine.close())
    errors = [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert errors == [], errors
