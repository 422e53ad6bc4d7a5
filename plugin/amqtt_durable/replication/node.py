"""One broker's replication: which end of the channel runs, switched by the HA loop.

``ReplicationNode`` is the HA loop's hooks (ha.HaHooks) over a store: as a backup it runs the
backup end towards the leader's address; promoted, it stops that end (its last write
finished) and serves backups as primary, numbering on from the store's position; demoted, it
stops acknowledging at once, fails the batches still waiting for backups, and becomes a
backup again (its store is then checked against the new primary's history, and replaced by a
snapshot if it diverged). Without a coordinator the role is fixed by the configuration and
``promote`` is the operator's decision.

The broker gives two callbacks: ``on_promote(primary)`` (load the store, accept clients, commit
through ``primary.prepare``/``committed``; it may return an awaitable, awaited before the node
counts as primary) and ``on_demote(reason)`` (acknowledge nothing more and close client
connections, synchronously; ``may_acknowledge`` is false already). ``on_demote`` may return an
awaitable that ends once the broker's last write to the store is finished: the node starts
following the new primary (reads its position, applies batches) only after it, and so does
a later promotion. A promotion whose ``on_promote`` fails leaves the node a backup (the HA
loop releases the lease and tries again later). Tools ask a node over its
replication address (STATUS, PROMOTE frames): the primary's channel server answers, and a
backup answers them itself. That address is bound once, at start, and closed at stop: a role
change hands its connections to the other end, so a promotion binds no port and cannot leave
the node without its tools (STATUS shows ``promotion_failed`` after a failed promotion).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from ..settings import LISTEN_BACKLOG
from .backup import Backup
from .config import ReplicationConfig
from .coordinator import Coordinator, Leader, Member
from .errors import (
    CoordinatorError,
    PromotionRefusedError,
    PromotionStoppedError,
    ReplicationError,
    ReplicationListenError,
)
from .framing import NOT_PRIMARY, Frame
from .gate import HandshakeGate
from .ha import Decision, HaNode
from .position import read_position, read_store_id
from .primary import Primary, first_frame
from .tool import join_address, split_address, split_peer_address

log = logging.getLogger("amqtt_durable.replication")

PROMOTING = "it is being promoted already (it serves clients once its store is loaded)"
HALF_SNAPSHOT = "its store holds a half-applied snapshot; let it catch up first"
"""Why ``promote`` refuses a node, with or without a coordinator."""


class ReplicationNode:
    """The replication side of one broker over its open store ``db``."""

    def __init__(
        self,
        db: Any,
        config: ReplicationConfig,
        *,
        coordinator: Coordinator | None = None,
        on_promote: Callable[[Primary], Awaitable[None] | None] | None = None,
        on_demote: Callable[[str], Awaitable[None] | None] | None = None,
        fsync: bool = True,
        listen_backlog: int = LISTEN_BACKLOG,
    ) -> None:
        self.db = db
        self.config = config
        self.on_promote = on_promote
        self.on_demote = on_demote
        self.primary: Primary | None = None
        self.fsync = fsync
        """Whether the backup end fsyncs what it applies: as the broker's own commits (``sync``)."""
        self.listen_backlog = listen_backlog
        """The listen backlog of the replication address, a primary's and a backup's (the tools'):
        the plugin's ``listen_backlog``."""
        self.secret = config.shared_secret()
        """replication.secret (or the content of secret_file or of the variable secret_env), read once at start-up."""
        tls = config.tls
        self.server_tls = tls.context(server=True) if tls is not None else None
        self.client_tls = tls.context(server=False) if tls is not None else None
        self.instance = secrets.randbits(64)
        """This broker process, in its backup end's HELLO (one for every term as a backup; the
        Backup sets its top byte to INSTANCE_MARK): a primary tells a reconnect of this backup
        from another broker under the same name by it."""
        self.backup = self._new_backup()
        self.ha = (
            HaNode(
                coordinator,
                self,
                name=config.name,
                address=config.advertised,
                loop_wait=config.loop_wait,
                demote_margin=config.demote_margin,
            )
            if coordinator is not None
            else None
        )
        self.decisions: list[Decision] = []
        self._following: str | None = None
        self._following_term = 0
        """The term of the leader followed at ``_following`` (``Leader.term``)."""
        self._follow_stop = asyncio.Event()
        self._follow_task: asyncio.Task[None] | None = None
        self._ends: set[asyncio.Task[None]] = set()
        self._ha_stop = asyncio.Event()
        self._ha_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Server | None = None
        """The replication address, bound once at start and closed at stop: a role change hands
        its connections to the other end (``_accept``), never closes and binds it again, so no
        other process can take the port in between and leave the node without its address."""
        self._admin_open = False
        """The backup's end (the tools' STATUS and PROMOTE) answers on the replication address."""
        self._serving: Primary | None = None
        """The primary end the replication address hands its connections to, from its start
        (before the broker loaded the store) until it closed."""
        self.promotion_failure: str | None = None
        """Why this node's last promotion failed (inspect shows it); None once one succeeded."""
        self._admin_gate = HandshakeGate(
            f"the replication address {config.listen}", allow_from=config.allowed_networks()
        )
        """The replication address's bound on connections in their handshake, and its counts of
        refused ones: the backup's tools and the primary end (which the address's one listener
        hands its connections to) share it."""
        self._stepping_down: asyncio.Task[None] | None = None
        """The last demotion's wind-down: following and promotion wait for it (see ``demote``)."""
        self._promoting = False
        """A promotion is under way: it, not a demotion's wind-down, reopens the admin address."""
        self._operator_promotion: asyncio.Task[None] | None = None
        """The promotion a tool's PROMOTE started: a second PROMOTE is refused until it ended
        (``promote``'s own guard, ``_promoting``, is set only once that task runs)."""

    def _new_backup(self) -> Backup:
        return Backup(
            self.db,
            name=self.config.name or "backup",
            sync=self.fsync,
            secret=self.secret,
            handshake_timeout=self.config.handshake_timeout,
            tls=self.client_tls,
            instance=self.instance,
        )

    def use_db(self, db: Any) -> None:
        """The broker reopened the store (after a failed write, or a failed promotion): every end
        uses the new handle."""
        self.db = db
        self.backup.db = db
        if self.primary is not None:
            self.primary.db = db

    def may_acknowledge(self) -> bool:
        """Whether a publish may be acknowledged now (before sync mode's wait for backups)."""
        if self.primary is None:
            return False
        return self.ha is None or self.ha.may_acknowledge()

    def status(self) -> dict[str, Any]:
        """Role, position and backups (and, with a coordinator, every member's published
        position as last read): what inspect, $SYS and a STATUS frame show."""
        primary = self.primary
        if primary is not None:
            status: dict[str, Any] = {
                "name": self.config.name,
                "role": "primary",
                "mode": self.config.mode,
                "batch": primary.log.head_seq,
                "backups": primary.status(),
            }
        else:
            status = {
                "name": self.config.name,
                "role": "backup",
                "state": self.backup.state,
                "batch": self.backup.applied_seq,
                # Caught up with an earlier primary than the coordinator's last one is not caught up.
                "caught_up": self.backup.caught_up and not (self.ha is not None and self.ha.caught_up_earlier),
                "primary": self._following,
                "queued_bytes": 0 if (queue := self.backup.received) is None else queue.bytes,
                "queue_full": queue is not None and queue.full,
            }
            if self.promotion_failure is not None:
                status["promotion_failed"] = self.promotion_failure
            if self.backup.refused is not None:
                status["refused_by_primary"] = self.backup.refused
            last = self.ha.last if self.ha is not None else None
            if last is not None and last.action == "wait":  # no primary followed: why (after a full stop, say)
                status["waiting"] = last.reason
                if last.waiting_for:  # the nodes it leaves the lease to or waits for
                    status["waiting_for"] = list(last.waiting_for)
        status["refused"] = self._admin_gate.refusals
        if self.ha is not None:
            status["members"] = [_member_row(m) for m in sorted(self.ha.members, key=lambda m: m.name)]
        return status

    def metrics(self) -> dict[str, object]:
        """``status`` flattened into $SYS/broker/durable/replication/... topics."""
        status = self.status()
        left_out = ("backups", "members", "name", "waiting", "waiting_for")
        flat: dict[str, object] = {f"replication/{key}": value for key, value in status.items() if key not in left_out}
        backups = status.get("backups", [])
        if status["role"] == "primary":
            flat["replication/backups"] = len(backups)
            flat["replication/backups_in_sync"] = sum(1 for row in backups if row["state"] == "in_sync")
        for row in backups:
            for key in ("state", "lag_batches", "lag_seconds", "snapshot_rows"):
                flat[f"replication/backup/{row['name']}/{key}"] = row[key]
        return flat

    async def start(self) -> None:
        host, _ = split_address(self.config.listen)
        if self.secret is None and self.config.tls is None and not _loopback(host):
            log.warning(
                "replication: %s listens on %s, not a loopback address, without replication.secret: anyone who "
                "can reach it can copy the store as a fake backup or promote a backup; set replication.secret_file "
                "(docs/replication.md, Securing the replication channel)",
                self.config.name or "this broker",
                self.config.listen,
            )
        await self._bind()
        if self.ha is None and self.config.role == "primary":
            with contextlib.suppress(PromotionStoppedError):  # stop() ran meanwhile: the broker closes
                await self.promote()
            return
        await self._open_admin()
        if self.ha is not None:
            self._ha_task = asyncio.get_running_loop().create_task(self.ha.run(self._ha_stop, self._decided))
            self._ha_task.add_done_callback(self._ha_ended)
        else:
            self.follow(self._configured_primary())

    def _ha_ended(self, task: asyncio.Task[None]) -> None:
        """The HA loop ends only at a stop; one ended by an exception is said, as an ERROR: the
        node keeps the primary it followed (if any), follows no new one and never takes over."""
        if task.cancelled() or task.exception() is None:
            return
        log.error(
            "replication HA %s: the HA loop ended: %r; until it restarts this node keeps the primary it "
            "followed (if any), follows no new one and never takes over",
            self.config.name or "this broker",
            task.exception(),
            exc_info=task.exception(),
        )

    async def drain(self) -> None:
        """A primary about to stop: wait (at most ``ack_timeout``) until every in-sync backup
        acknowledged every batch written so far, so a clean stop leaves nothing acknowledged
        behind. The broker writes its last batches before it calls this."""
        if self.primary is not None:
            log.info(
                "replication: %s stops: waiting (at most %g s) until the backups have batch %d",
                self.config.name or "the primary",
                self.config.ack_timeout,
                self.primary.log.head_seq,
            )
            await self.primary.wait_shipped(within=self.config.ack_timeout)

    async def stop(self) -> None:
        self._ha_stop.set()
        if self._ha_task is not None:
            # A primary releases its lease on the way out. A loop that failed was logged when it
            # ended (_ha_ended): the clean-up below runs all the same, so the address is closed.
            with contextlib.suppress(Exception):
                await self._ha_task
        await self._stop_following()
        if self.primary is not None:
            await self._close_serving(self.primary, "the broker stops")
            self.primary = None
        for task in list(self._closing):
            await _ended(task)
        await self._close_admin()
        server, self._listener = self._listener, None
        if server is not None:
            server.close()
            self._admin_gate.abort_all()
            await server.wait_closed()

    async def _bind(self) -> None:
        """Listen on the replication address (once: a ReplicationListenError names it and why)."""
        if self._listener is None:
            host, port = split_address(self.config.listen)
            # TLS (server_tls) is started in first_frame, once the gate admitted the connection.
            with _listening_on(self.config.listen):
                self._listener = await asyncio.start_server(self._accept, host, port, backlog=self.listen_backlog)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection to the replication address: the primary end's while one serves (a
        closed one aborts it), otherwise the backup's answers to tools."""
        serving = self._serving
        if serving is not None:
            await serving.serve(reader, writer)
        else:
            await self._answer_tool(reader, writer)

    async def _open_admin(self) -> None:
        await self._bind()
        self._admin_open = True

    async def _close_admin(self) -> None:
        """The backup's end stops answering (a promotion, a stop); the address stays bound."""
        if self._admin_open:
            self._admin_open = False
            self._admin_gate.abort_all()

    async def _answer_tool(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A backup's replication address: tools' questions; a backup's HELLO is not for it."""
        host, port = writer.get_extra_info("peername")[:2]
        peer = join_address(host, port)
        if not self._admin_open:  # accepted while the role changes, or as the node stops: past their abort_all
            writer.transport.abort()
            return
        if not self._admin_gate.admit(writer, host):
            return
        try:
            session, kind, _ = await first_frame(
                reader,
                writer,
                self.secret,
                self.config.handshake_timeout,
                peer,
                tls=self.server_tls,
                gate=self._admin_gate,
            )
            if kind in (Frame.STATUS, Frame.PROMOTE):
                writer.write(session.encode(kind, json.dumps(self.answer(kind)).encode()))
                await writer.drain()
            elif kind == Frame.HELLO:  # a backup whose replication.primary names this backup
                writer.write(session.encode(Frame.ERROR, self.not_primary().encode("utf-8")))
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ReplicationError) as exc:
            log.info("replication: a connection to %s ended: %r", self.config.listen, exc)
        except asyncio.CancelledError:
            pass  # a stop or a promotion (abort_all): not raised on, asyncio would log it as an error
        finally:
            self._admin_gate.done(writer)
            writer.close()

    def not_primary(self) -> str:
        """The ERROR frame's text for a backup's HELLO on this backup's replication address: that
        this node is no primary (the fixed words first: the refused backup shows at most 200
        characters), and the address it follows, which may be the primary."""
        backup = self.config.name or f"at {self.config.listen}"
        following = f"follows {self._following}" if self._following else "follows no primary yet"
        return f"{NOT_PRIMARY}: backup {backup} ({following}); replication.primary must name the primary's address"

    def answer(self, kind: Frame) -> dict[str, Any]:
        """A tool's STATUS or PROMOTE (``amqtt-durable promote``: the operator's decision)."""
        if kind == Frame.STATUS:
            return self.status()
        if self.primary is not None:
            return {"promoted": False, "why": "it is the primary already"}
        if self._ha_stop.is_set():
            return {"promoted": False, "why": "the broker stops"}
        if self.ha is not None:
            return self._request_takeover()
        under_way = self._operator_promotion
        if self._promoting or (under_way is not None and not under_way.done()):
            # A second PROMOTE (two operators, a retried command) must not start a second
            # promotion: promote would refuse it (PromotionRefusedError), and that failure's
            # path in _promote_by_operator would start following the old primary again under
            # the new one.
            return {"promoted": False, "why": PROMOTING}
        if read_position(self.db) is None:
            return {"promoted": False, "why": HALF_SNAPSHOT}
        behind = "" if self.backup.caught_up else f" (it was {self.backup.state} at batch {self.backup.applied_seq})"
        log.warning("replication: %s promoted by the operator%s", self.config.name or "this backup", behind)
        task = asyncio.get_running_loop().create_task(self._promote_by_operator())
        self._operator_promotion = task
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return {"promoted": True, "why": "promoted by the operator" + behind}

    def _request_takeover(self) -> dict[str, Any]:
        """PROMOTE on a node with a coordinator: it takes the free lease at its next HA cycle."""
        assert self.ha is not None
        if self._promoting:
            return {"promoted": False, "why": PROMOTING}
        if read_position(self.db) is None:
            return {"promoted": False, "why": HALF_SNAPSHOT}
        refused = self.ha.request_takeover()
        if refused is not None:
            return {"promoted": False, "why": refused}
        behind = "" if self.backup.caught_up else f", at batch {self.backup.applied_seq}, not known to be caught up,"
        return {
            "promoted": True,
            "why": f"the operator's decision: no primary holds the lease; this node{behind} takes it at its next "
            "HA cycle unless another node takes it first",
        }

    async def _promote_by_operator(self) -> None:
        try:
            await self.promote()
        except PromotionStoppedError:
            pass  # the broker stops (logged by the promotion)
        except Exception as exc:
            name = self.config.name or "this backup"
            log.error("replication: %s: the promotion failed: %s; still a backup", name, exc)
            if not self._ha_stop.is_set() and self.config.primary:
                self.follow(self._configured_primary())

    def _configured_primary(self) -> Leader:
        """The primary a fixed-role backup follows (replication.primary), its address as STATUS shows it."""
        assert self.config.primary is not None
        return Leader("primary", join_address(*split_address(self.config.primary)))

    def _decided(self, decision: Decision) -> None:
        self.decisions.append(decision)

    # --- ha.HaHooks -------------------------------------------------------------------------

    def caught_up(self) -> bool:
        return self.primary is None and self.backup.caught_up

    def position(self) -> tuple[int, int]:
        primary = self.primary
        if primary is not None:
            return primary.store_id, primary.log.head_seq
        return self.backup.store_id, self.backup.applied_seq

    def store_whole(self) -> bool:
        return self.primary is not None or (not self.backup.partial and self.backup.applied_seq > 0)

    def follow(self, leader: Leader) -> None:
        same = self._following == leader.address and self._following_term == leader.term
        if same and self._follow_task is not None and not self._follow_task.done():
            return
        previous = self._follow_task
        if previous is not None:
            self._follow_stop.set()
            previous.cancel()
        if not same:
            # Caught up with the last primary only: a new one, or the same node in a later term
            # (it took the lease again), decides anew (its IN_SYNC), also when it dies before it
            # answered. (The cancelled end sets caught_up no more.)
            self.backup.caught_up = False
        self._following, self._following_term = leader.address, leader.term
        self._follow_stop = asyncio.Event()
        host, port = split_peer_address(leader.address, f"the coordinator's leader key (written by {leader.name})")
        self._follow_task = asyncio.get_running_loop().create_task(
            self._follow(set(self._ends), host, port, self._follow_stop)
        )
        self._ends.add(self._follow_task)
        self._follow_task.add_done_callback(self._ends.discard)

    async def _follow(self, previous: set[asyncio.Task[None]], host: str, port: int, stop: asyncio.Event) -> None:
        for task in previous:
            await _ended(task)
        await self._stepped_down()  # the demoted broker's last write is finished; the backup end starts after it
        await self.backup.follow(host, port, stop, retry=min(0.5, self.config.loop_wait))

    async def _stepped_down(self) -> None:
        task = self._stepping_down
        if task is not None:
            await _ended(task)

    async def _stop_following(self) -> None:
        task, self._follow_task, self._following = self._follow_task, None, None
        if task is not None:
            self._follow_stop.set()
            task.cancel()
        for end in list(self._ends):
            await _ended(end)  # the backup end's last write is finished

    async def promote(self) -> None:
        """Become primary (see the module's docstring). Refused (PromotionRefusedError, the node
        unchanged) while another promotion is under way or a primary end serves already;
        PromotionStoppedError when stop() ended it before the node served."""
        if self._promoting:
            raise PromotionRefusedError(f"replication: {self.config.name or 'this broker'} is being promoted already")
        if self.primary is not None:  # before any step of the promotion, so the node is left as it is
            raise PromotionRefusedError(self._serves_already())
        self._promoting = True
        try:
            await self._promote()
        finally:
            self._promoting = False

    async def _promote(self) -> None:
        if read_position(self.db) is None:
            raise ReplicationError(
                f"replication: {self.config.name or 'this broker'} cannot become primary: its store holds "
                "a half-applied snapshot. Start it as a backup so it catches up, or delete the store folder"
            )
        await self._stop_following()
        await self._stepped_down()
        await self._close_admin()
        try:
            await self._serve_as_primary()
        except PromotionStoppedError:
            raise  # the broker stops: nothing failed, and stop() closes the address
        except PromotionRefusedError:
            # An end serves already: it is left as it is. promote() refused a serving primary
            # before any step; an end still serving here (one closing at a demotion is waited
            # for above, and promotions run one at a time) would be a bug: not hidden, not closed.
            raise
        except BaseException as exc:
            # Whatever failed, the node is a backup again and its tools answer on its address.
            self.primary = None
            if not isinstance(exc, asyncio.CancelledError):
                self.promotion_failure = str(exc) or repr(exc)
            if not self._ha_stop.is_set():
                await self._open_admin()
            raise

    def _serves_already(self) -> str:
        return f"replication: {self.config.name or 'this broker'} cannot become primary: a primary end serves already"

    async def _serve_as_primary(self) -> None:
        if self._ha_stop.is_set():
            # stop() ran during the awaits before: it closed ``primary`` (None then) and closes
            # the address after this promotion ends; the broker closes, so nothing is loaded.
            log.info("replication: %s stops: its promotion ends here", self.config.name or "this broker")
            raise PromotionStoppedError(f"replication: {self.config.name or 'this broker'} stops: not promoted")
        if self._serving is not None:
            # Never replace a serving end: the replaced one would be orphaned (never closed, not
            # even by stop, its tasks pending). No await between this check and ``_serving = ``.
            raise PromotionRefusedError(self._serves_already())
        _, port = split_address(self.config.listen)
        primary = Primary(
            self.db,
            store_id=read_store_id(self.db),
            log_max_batches=self.config.retained_batches,
            log_max_bytes=self.config.retained_bytes,
            ack_timeout=self.config.ack_timeout,
            catch_up_timeout=self.config.catch_up_timeout,
            max_backups=self.config.max_backups,
            chunk_bytes=self.config.snapshot_chunk_bytes,
            publish_sync_set=self._publish_sync_set if self.ha is not None and self.config.mode == "sync" else None,
            delete_sync_set=self._delete_sync_set if self.ha is not None and self.config.mode == "async" else None,
            secret=self.secret,
            handshake_timeout=self.config.handshake_timeout,
            gate=self._admin_gate,
            backlog=self.listen_backlog,
        )
        primary.on_admin = self.answer
        primary.serve_accepted(port, self.server_tls)  # on the address bound at start: nothing to bind
        self._serving = primary
        if self.ha is not None and self.ha.role != "primary":
            # The lease's deadline passed during the awaits above (its demotion found no primary
            # yet): this term is over before it began; serving now would be a primary HA calls a backup.
            await self._close_serving(primary, "the lease ended while the promotion was under way")
            await self._stepped_down()
            if not self._ha_stop.is_set():
                await self._open_admin()
            return
        self.primary = primary
        try:
            if self.on_promote is not None:
                loading = self.on_promote(primary)
                if inspect.isawaitable(loading):
                    await loading
        except BaseException as exc:
            self.primary = None
            await self._close_serving(primary, f"the promotion failed ({exc})")
            raise
        await self._loaded(primary)

    async def _loaded(self, primary: Primary) -> None:
        """The broker loaded the store for ``primary``: the node is primary now, unless it was
        demoted or its stop began meanwhile."""
        if self.primary is not primary:  # demoted while the broker was loading (its on_demote has run)
            await self._stepped_down()
            if not self._ha_stop.is_set():
                await self._open_admin()
            return
        if self._ha_stop.is_set():
            await self._stopped_while_loading(primary)
        self.promotion_failure = None
        primary.delete_earlier_sync_set()  # async mode: only now, so a failed promotion leaves the set
        log.warning("replication: %s is primary from batch %d", self.config.name, primary.log.head_seq)

    async def _stopped_while_loading(self, primary: Primary) -> None:
        """stop() began while the broker loaded the store: this term ends before it served. The
        broker's work stops as at a demotion (quietly: the node never was primary), then
        PromotionStoppedError: the HA loop records "stopped" and releases the lease."""
        self.primary = None
        stopping = self.on_demote("the broker stops") if self.on_demote is not None else None
        await self._close_serving(primary, "the broker stops")
        if stopping is not None:
            try:
                await stopping
            except Exception:
                log.exception("replication: %s: stopping the broker's work failed", self.config.name)
        log.info(
            "replication: %s stops: its promotion ends here, its store loaded: not primary",
            self.config.name or "this broker",
        )
        raise PromotionStoppedError(f"replication: {self.config.name or 'this broker'} stops: not promoted")

    async def _close_serving(self, primary: Primary, reason: str) -> None:
        """Close a primary end; the replication address stops handing it connections."""
        try:
            await primary.close(reason)
        finally:
            if self._serving is primary:
                self._serving = None

    async def _delete_sync_set(self) -> None:
        await self._publish_sync_set(None)

    async def _publish_sync_set(self, members: frozenset[str] | None) -> None:
        assert self.ha is not None
        async with asyncio.timeout(self.config.ack_timeout):
            if not await self.ha.coordinator.publish_sync(self.ha.me, members):
                raise CoordinatorError(", ".join(self.config.coordinator), "this node no longer holds the lease")

    def demote(self, reason: str) -> None:
        primary, self.primary = self.primary, None  # may_acknowledge is false from here on
        log.warning("replication: %s: %s", self.config.name, reason)
        stopping = self.on_demote(reason) if self.on_demote is not None else None
        task = asyncio.get_running_loop().create_task(self._step_down(primary, reason, stopping))
        self._stepping_down = task
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self.backup = self._new_backup()  # not caught up

    async def _step_down(self, primary: Primary | None, reason: str, stopping: Awaitable[None] | None) -> None:
        """The demotion's wind-down. The broker's own writes end first (``stopping``: its last
        write in the worker thread is finished), and only then is the store read for the
        backup end's position: a write still in flight would otherwise land after the new
        primary's batches, or be missing from the position the backup starts from."""
        if primary is not None:
            await self._close_serving(primary, reason)
        if stopping is not None:
            try:
                await stopping
            except Exception:
                log.exception("replication: %s: stopping the broker's work at the demotion failed", self.config.name)
        self.backup = self._new_backup()
        if not self._ha_stop.is_set() and not self._promoting:
            await self._open_admin()


def _member_row(member: Member) -> dict[str, Any]:
    """One member's published record as STATUS shows it (inspect's ``members``)."""
    return {
        "name": member.name,
        "role": member.role,
        "store_id": member.store_id,
        "batch": member.seq,
        "candidate": member.candidate,
        "promotion_failed": member.promotion_failed,
    }


@contextlib.contextmanager
def _listening_on(address: str) -> Iterator[None]:
    """A listener on ``address`` that cannot be opened (in use, no such host) raises
    ReplicationListenError naming the address and why."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise ReplicationListenError(address, exc) from exc


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":  # a host name's case does not matter (LOCALHOST resolves as localhost)
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


async def _ended(task: asyncio.Task[None]) -> None:
    """Wait for a cancelled backup end; a failure it ended with is logged, not raised again."""
    await asyncio.wait({task})  # our own cancellation still propagates
    if not task.cancelled() and (failure := task.exception()) is not None:
        log.error("replication: the backup end failed: %r", failure)
