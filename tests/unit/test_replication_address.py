"""A node's replication address across role changes, over real sockets and real stores: a
promotion hands the bound address from the backup's tools to the primary end instead of
closing it and binding it again, so another process that grabs the port at that moment gets
nothing (before: the promotion failed and the tools' listener stayed closed for good); a
promotion that fails after the tools stopped answering leaves a backup whose tools answer
again and show why it failed, until one succeeds; with a coordinator the lease is given back.
Promotions asked for at once make one primary end, never a second that nothing would close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import bounded, primary_store
from test_replication_ha import Clock, FakeCoordinator

from amqtt_durable.errors import DamagedRecordError
from amqtt_durable.process import free_port
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.errors import ReplicationError
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.position import position_op
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask, format_status, split_address

HOST = "127.0.0.1"
DAMAGED = "the session record of 'device-1': 3 bytes that do not decode"
"""What a promotion fails with here: the store does not load (a damaged record)."""


class Squatted(ReplicationNode):
    """Another process's socket tries to take the replication port at the moment the
    promotion has stopped the backup's tools (the squatter of the attack: bound and listening)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.squatter: socket.socket | None = None
        self.refused: OSError | None = None

    async def _close_admin(self) -> None:
        await super()._close_admin()
        if self._promoting and self.squatter is None and self.refused is None:
            sock = socket.socket()
            # As a real server would: the node's closed tool connections in TIME_WAIT on the port
            # must not be what stops it (only a socket still listening there may).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(split_address(self.config.listen))
                sock.listen()
            except OSError as exc:
                sock.close()
                self.refused = exc
            else:
                self.squatter = sock


def node_config(by: str) -> tuple[ReplicationConfig, FakeCoordinator | None]:
    """A backup promoted by ``by`` (the operator: a fixed-role backup of a primary that is not
    there; the lease: a coordinator of a new cluster, whose bootstrap this node claims)."""
    listen = f"{HOST}:{free_port()}"
    if by == "the operator":
        return ReplicationConfig(name="b", role="backup", primary=f"{HOST}:{free_port()}", listen=listen), None
    config = ReplicationConfig(
        name="b",
        role="auto",
        listen=listen,
        coordinator=["http://127.0.0.1:1"],
        lease_ttl=10,
        loop_wait=0.1,
        demote_margin=1.0,
    )
    return config, FakeCoordinator(Clock(), ttl=10.0)


async def status_when(listen: str, shows: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Ask the node's tools until their answer ``shows`` what is awaited (bounded by the caller);
    a question the node aborted as its role changed is asked again."""
    while True:
        with contextlib.suppress(ReplicationError):
            status = await ask(listen, Frame.STATUS)
            if shows(status):
                return status
        await asyncio.sleep(0.02)  # polling the node's answers, not synchronising on time


def backup_store(tmp_path: Path) -> Any:
    """A store a backup holds before its first batch (position 0)."""
    db, _ = primary_store(tmp_path / "b")
    db.put(*position_op(0, 0))
    return db


async def promote_by_the_operator(by: str, listen: str) -> None:
    """The operator's PROMOTE, answered ``promoted`` (the lease promotes the node by itself)."""
    if by == "the operator":
        answer = await bounded(ask(listen, Frame.PROMOTE), 15)
        assert answer["promoted"] is True, answer


async def wait_role(listen: str, role: str) -> dict[str, Any]:
    return await status_when(listen, lambda status: status["role"] == role)


async def failure_shown(listen: str) -> dict[str, Any]:
    return await status_when(listen, lambda status: "promotion_failed" in status)


@pytest.mark.parametrize("by", ["the operator", "the lease"])
def test_a_port_grabbed_as_the_promotion_starts_gets_nothing_and_the_node_serves(tmp_path: Path, by: str) -> None:
    db = backup_store(tmp_path)

    async def main() -> None:
        config, coordinator = node_config(by)
        served: list[Primary] = []
        replication = Squatted(db, config, coordinator=coordinator, on_promote=served.append)
        await replication.start()
        try:
            await promote_by_the_operator(by, config.listen)
            status = await bounded(wait_role(config.listen, "primary"), 15)
            assert replication.squatter is None, "another process took the replication port during the promotion"
            assert isinstance(replication.refused, OSError)
            assert len(served) == 1 and replication.primary is served[0]
            assert "promotion_failed" not in status
        finally:
            if replication.squatter is not None:
                replication.squatter.close()
            await replication.stop()

    asyncio.run(main())
    db.close()


@pytest.mark.parametrize("by", ["the operator", "the lease"])
def test_a_failed_promotion_leaves_a_backup_whose_tools_answer_and_say_why(tmp_path: Path, by: str) -> None:
    db = backup_store(tmp_path)

    async def main() -> None:
        config, coordinator = node_config(by)
        tried = asyncio.Event()

        def on_promote(primary: Primary) -> None:
            tried.set()
            raise DamagedRecordError(DAMAGED)

        replication = ReplicationNode(db, config, coordinator=coordinator, on_promote=on_promote)
        await replication.start()
        try:
            await promote_by_the_operator(by, config.listen)
            await bounded(tried.wait(), 15)
            status = await bounded(failure_shown(config.listen), 15)
            assert status["role"] == "backup" and replication.primary is None
            assert status["promotion_failed"] == DAMAGED
            assert f"its last promotion failed: {DAMAGED}" in format_status(status)
            if coordinator is not None:
                assert any("released the lease, still a backup" in d.reason for d in replication.decisions)
        finally:
            await replication.stop()

    asyncio.run(main())
    db.close()


class SlowLoad:
    """An on_promote whose load of the store lasts until ``loaded`` is set: ``served`` holds the
    primary ends it was given, ``loading`` is set once a load started."""

    def __init__(self) -> None:
        self.served: list[Primary] = []
        self.loading = asyncio.Event()
        self.loaded = asyncio.Event()

    async def __call__(self, primary: Primary) -> None:
        self.served.append(primary)
        self.loading.set()
        await self.loaded.wait()


def others() -> list[asyncio.Task[object]]:
    """The tasks still pending but the test's own."""
    return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]


def test_three_promotes_at_once_make_one_primary_end_and_stop_leaves_nothing_running(tmp_path: Path) -> None:
    """Two operators (or a retried command) send PROMOTE while the first promotion is loading the
    store. Before: each started a promotion that made a primary end; the last one replaced the
    others, which nothing closed (not even stop), their watchdog tasks pending for good."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        served: list[Primary] = []
        loaded = asyncio.Event()

        async def on_promote(primary: Primary) -> None:
            served.append(primary)
            await loaded.wait()  # the store loads until every PROMOTE was answered

        replication = ReplicationNode(db, config, on_promote=on_promote)
        await replication.start()
        try:
            answers = await bounded(
                asyncio.gather(*(ask(config.listen, Frame.PROMOTE) for _ in range(3)), return_exceptions=True), 15
            )
            promoted = [answer for answer in answers if isinstance(answer, dict) and answer["promoted"]]
            assert len(promoted) == 1, answers
            refused = [answer for answer in answers if isinstance(answer, dict) and not answer["promoted"]]
            assert all(answer["why"].startswith("it is being promoted already") for answer in refused), refused
            loaded.set()
            await bounded(wait_role(config.listen, "primary"), 15)
            assert len(served) == 1 and replication.primary is served[0], served
        finally:
            loaded.set()
            await replication.stop()
        assert others() == []
        assert all(primary._closed is not None and not primary._tasks for primary in served)

    asyncio.run(main())
    db.close()


def test_a_promotion_while_one_is_under_way_or_an_end_serves_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """``promote`` itself (the HA loop's hook, a fixed primary's start) never makes a second primary
    end: refused while a promotion is under way, and on a node whose primary end serves already.
    Before: each call made an end and replaced the serving one, which nothing closed."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        on_promote = SlowLoad()
        served, loading, loaded = on_promote.served, on_promote.loading, on_promote.loaded
        replication = ReplicationNode(db, config, on_promote=on_promote)
        await replication.start()
        try:
            first = asyncio.get_running_loop().create_task(replication.promote())
            await bounded(loading.wait(), 15)
            with pytest.raises(ReplicationError, match="is being promoted already"):
                await bounded(replication.promote(), 15)
            loaded.set()
            await bounded(first, 15)
            with pytest.raises(ReplicationError, match="a primary end serves already"):
                await bounded(replication.promote(), 15)
            assert len(served) == 1 and replication.primary is served[0], served
            status = await bounded(ask(config.listen, Frame.STATUS), 15)  # handed to the one end
            assert status["role"] == "primary" and "promotion_failed" not in status, status
            assert replication.promotion_failure is None
        finally:
            loaded.set()
            await replication.stop()
        assert others() == []
        assert served and all(primary._closed is not None and not primary._tasks for primary in served)

    asyncio.run(main())
    db.close()


@pytest.mark.parametrize("by", ["the operator", "the lease"])
def test_a_promotion_after_a_failed_one_succeeds_and_clears_promotion_failed(tmp_path: Path, by: str) -> None:
    """A failed promotion is shown (promotion_failed) until one succeeds; ``promote`` can be run
    again once the cause is fixed (the lease tries again by itself at its next cycles)."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, coordinator = node_config(by)
        repaired = asyncio.Event()
        served: list[Primary] = []

        def on_promote(primary: Primary) -> None:
            if not repaired.is_set():
                raise DamagedRecordError(DAMAGED)
            served.append(primary)

        replication = ReplicationNode(db, config, coordinator=coordinator, on_promote=on_promote)
        await replication.start()
        try:
            await promote_by_the_operator(by, config.listen)
            failed = await bounded(failure_shown(config.listen), 15)
            assert failed["role"] == "backup"
            repaired.set()
            await promote_by_the_operator(by, config.listen)  # again, once the cause is fixed
            status = await bounded(wait_role(config.listen, "primary"), 15)
            assert "promotion_failed" not in status and replication.promotion_failure is None
            assert len(served) == 1 and replication.primary is served[0]
            if by == "the operator":  # a backup again: nothing of the old failure is shown
                replication.demote("the test demotes it")
                assert replication._stepping_down is not None
                await bounded(replication._stepping_down, 15)  # its tools answer again from here on
                backup = await bounded(ask(config.listen, Frame.STATUS), 15)
                assert "promotion_failed" not in backup, backup
                assert "its last promotion failed" not in format_status(backup)
        finally:
            await replication.stop()

    asyncio.run(main())
    db.close()


@pytest.mark.parametrize(
    "when",
    [
        "PROMOTE, then stop at once",
        "PROMOTE, stop as the store loads",
        "a fixed primary's start, stop as the store loads",
    ],
)
def test_a_stop_during_a_promotion_leaves_no_primary_serving(tmp_path: Path, when: str) -> None:
    """The broker stops while a promotion is under way. A promotion not yet loading the store
    does not load it (no on_promote once stopping); one loading it finishes first and its end
    is closed by stop. Before: stop closed ``primary`` (still None) and only then waited for
    the promotion, which set it and stayed serving after stop returned (on_promote run as the
    broker closed)."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        if when.startswith("a fixed primary"):
            config = ReplicationConfig(name="p", role="primary", listen=config.listen)
        on_promote = SlowLoad()
        served, loading, loaded = on_promote.served, on_promote.loading, on_promote.loaded
        replication = ReplicationNode(db, config, on_promote=on_promote)
        loop = asyncio.get_running_loop()
        try:
            if when == "PROMOTE, then stop at once":  # the promotion has not reached the store's load
                loaded.set()
                await replication.start()
                assert replication.answer(Frame.PROMOTE)["promoted"] is True
                await bounded(replication.stop(), 15)
                assert served == []
                assert replication.answer(Frame.PROMOTE) == {"promoted": False, "why": "the broker stops"}
            else:
                if when.startswith("PROMOTE"):
                    await replication.start()
                    assert replication.answer(Frame.PROMOTE)["promoted"] is True
                    starting = None
                else:
                    starting = loop.create_task(replication.start())
                await bounded(loading.wait(), 15)
                stopping = loop.create_task(replication.stop())
                await asyncio.sleep(0)  # stop runs up to its wait for the promotion
                loaded.set()
                await bounded(stopping, 15)
                if starting is not None:
                    await bounded(starting, 15)
                assert len(served) == 1 and served[0]._closed is not None
        finally:
            loaded.set()
        assert replication.primary is None and replication._serving is None
        with pytest.raises(ReplicationError):  # nothing answers on the address any more
            await bounded(ask(config.listen, Frame.STATUS), 15)
        assert others() == []

    asyncio.run(main())
    db.close()


def test_a_node_promoted_by_the_operator_then_demoted_can_be_promoted_again(tmp_path: Path) -> None:
    """A PROMOTE is refused only while the promotion it started is under way. Before: the
    guard was cleared only when that promotion failed, so once it had succeeded every later
    PROMOTE (after a demotion) was refused with 'being promoted already'."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        served: list[Primary] = []
        replication = ReplicationNode(db, config, on_promote=served.append)
        await replication.start()
        try:
            await promote_by_the_operator("the operator", config.listen)
            await bounded(wait_role(config.listen, "primary"), 15)
            replication.demote("the test demotes it")
            assert replication._stepping_down is not None
            await bounded(replication._stepping_down, 15)
            await promote_by_the_operator("the operator", config.listen)
            await bounded(wait_role(config.listen, "primary"), 15)
            assert len(served) == 2 and replication.primary is served[1]
        finally:
            await replication.stop()

    asyncio.run(main())
    db.close()


def ipv6_loopback() -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return True
    return False


class Logged(logging.Handler):
    """Sets ``seen`` once a record's message holds ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_status_and_logs_show_ipv6_addresses_in_brackets(tmp_path: Path) -> None:
    """STATUS (and inspect, which prints it) and the log write an IPv6 address as ``[::1]:7883``,
    as the configuration does, never ``::1:7883`` (the port not told from the address): the
    primary a fixed-role backup follows (also in its log), and each backup's peer on the
    primary. Before: all bare."""
    db = backup_store(tmp_path / "b")
    primary_db, _ = primary_store(tmp_path / "p")

    async def main() -> None:
        primary_listen = f"[::1]:{free_port('::1')}"
        primary = ReplicationNode(primary_db, ReplicationConfig(name="p", role="primary", listen=primary_listen))
        config = ReplicationConfig(name="b", role="backup", primary=primary_listen, listen=f"[::1]:{free_port('::1')}")
        backup = ReplicationNode(db, config)
        logged = Logged(f"replication: backup b: channel to {primary_listen} ended")
        logging.getLogger("amqtt_durable.replication").addHandler(logged)
        await backup.start()  # before its primary: its channel fails, and the log says to where
        try:
            await bounded(logged.seen.wait(), 15)
            await primary.start()
            status = await bounded(ask(config.listen, Frame.STATUS), 15)
            assert status["primary"] == primary_listen, status
            rows = await bounded(
                status_when(primary_listen, lambda status: any(row["name"] == "b" for row in status["backups"])), 15
            )
            peer = next(row["peer"] for row in rows["backups"] if row["name"] == "b")
            host, port = split_address(peer)
            assert peer == f"[{host}]:{port}" and host == "::1", peer
            assert f"({peer})" in format_status(rows)
        finally:
            logging.getLogger("amqtt_durable.replication").removeHandler(logged)
            await backup.stop()
            await primary.stop()

    asyncio.run(main())
    db.close()
    primary_db.close()
