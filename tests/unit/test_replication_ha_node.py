"""The HA loop of a real ReplicationNode (real sockets, a real store; the coordinator is the
fake of test_replication_ha): what it reads from other nodes, how it ends, what a stop during
its promotion records."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from replication_helpers import bounded
from test_replication_address import Logged, SlowLoad, backup_store, node_config
from test_replication_ha import FakeCoordinator

from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader
from amqtt_durable.replication.errors import PromotionRefusedError, ReplicationError
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.ha import Decision
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.tool import ask, split_address, split_peer_address

LOG = logging.getLogger("amqtt_durable.replication")


class Decided(ReplicationNode):
    """Sets ``decided`` once the HA loop made a decision whose action is ``awaited``."""

    awaited = "follow"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.decided = asyncio.Event()

    def _decided(self, decision: Decision) -> None:
        super()._decided(decision)
        if decision.action == self.awaited:
            self.decided.set()


def test_a_leader_address_written_without_brackets_is_followed(tmp_path: Path) -> None:
    """A node from before addresses were bracketed publishes its replication.listen as it is
    (``::1:7883``) in the leader key: a backup follows it, the port after the last colon. Before:
    reading it raised inside the HA loop, which ended silently; the node followed nothing."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, fake = node_config("the lease")
        assert isinstance(fake, FakeCoordinator)
        fake.holder, fake.expires = Leader("old", "::1:7883"), 1e18
        node = Decided(db, config, coordinator=fake)
        await node.start()
        try:
            await bounded(node.decided.wait(), 15)
            assert node._following == "::1:7883"
            assert node._follow_task is not None and not node._follow_task.done()
            assert node._ha_task is not None and not node._ha_task.done()
        finally:
            await bounded(node.stop(), 15)

    asyncio.run(main())
    db.close()


def test_a_peer_address_is_read_leniently_and_the_configuration_strictly() -> None:
    where = "the coordinator's leader key (written by old)"
    assert split_peer_address("2001:db8::10:7883", where) == ("2001:db8::10", 7883)
    assert split_peer_address("[::1]:7883", where) == ("::1", 7883)
    assert split_peer_address("127.0.0.1:7883", where) == ("127.0.0.1", 7883)
    # What an older node accepted in its listen/advertise and published as written.
    assert split_peer_address("[10.0.0.1]:7883", where) == ("10.0.0.1", 7883)
    assert split_peer_address("[node-a.example]:7883", where) == ("node-a.example", 7883)
    bad_bare = ("::1 x:7883", "fe80::1/64:7883", "a:b\tc:7883", "::1\n:7883", "a:b:7883", "::1\x00:7883")
    for wrong in (
        *("::1:0", "::1:x", "[::1:7883", "::1]:7883", "7883", "host", "[]:7883", "[a b]:7883", "[[a]]:7883"),
        *bad_bare,  # review 143: the unbracketed branch took any host with a colon, not only IPv6 addresses
    ):
        with pytest.raises(ReplicationError, match="in the coordinator's leader key") as raised:
            split_peer_address(wrong, where)
        assert "replication.listen" not in str(raised.value)
    with pytest.raises(ReplicationError, match="brackets"):
        split_address("2001:db8::10:7883")
    with pytest.raises(ReplicationError, match="brackets"):
        split_address("[10.0.0.1]:7883")


def test_a_peer_addresss_port_is_ascii_digits_in_the_lenient_reading_too() -> None:
    """The lenient fallback read its port with str.isdigit() and int(), as the strict reading did
    before: a superscript digit raised int()'s bare ValueError, an Arabic-Indic digit was port 3."""
    where = "the coordinator's leader key (written by old)"
    for wrong in ("db1:\u00b2", "2001:db8::10:\u0663", "[10.0.0.1]:\u0663", "2001:db8::10:\uff17\uff18\uff18\uff13"):
        with pytest.raises(ReplicationError, match="in the coordinator's leader key"):
            split_peer_address(wrong, where)


class Failing(ReplicationNode):
    """A hook of the HA loop raises what the loop does not expect."""

    def position(self) -> tuple[int, int]:
        raise RuntimeError("the position hook fails")


def test_an_ha_loop_ended_by_an_exception_is_logged_and_stop_closes_the_address(tmp_path: Path) -> None:
    """Before: the loop's end was said nowhere, and stop() raised the loop's exception before it
    closed the replication address (left bound and answering)."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, fake = node_config("the lease")
        node = Failing(db, config, coordinator=fake)
        logged = Logged("the HA loop ended: RuntimeError('the position hook fails')")
        LOG.addHandler(logged)
        try:
            await node.start()
            await bounded(logged.seen.wait(), 15)
            await bounded(node.stop(), 15)
        finally:
            LOG.removeHandler(logged)
        assert node._listener is None
        with pytest.raises(ReplicationError):  # nothing answers on the address any more
            await bounded(ask(config.listen, Frame.STATUS), 15)

    asyncio.run(main())
    db.close()


class StopDuring(ReplicationNode):
    """The broker's stop begins while the HA loop's promotion waits for the old role to end."""

    stopping: asyncio.Task[None] | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.stop_begun = asyncio.Event()

    async def _stepped_down(self) -> None:
        await super()._stepped_down()
        if self._promoting and self.stopping is None:
            self.stopping = asyncio.get_running_loop().create_task(self.stop())
            self.stop_begun.set()
            await asyncio.sleep(0)  # stop() begins: it sets _ha_stop and waits for the HA loop


def test_a_stop_during_a_lease_promotion_is_recorded_as_a_stop_not_as_a_new_primary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the promotion returned as if it had succeeded and the HA loop logged "took the
    leader lease, now primary" for a node that never served; the lease was kept until the
    loop's exit demoted the node."""
    caplog.set_level(logging.INFO, "amqtt_durable.replication")
    db = backup_store(tmp_path)
    served: list[object] = []

    async def main() -> None:
        config, fake = node_config("the lease")
        assert isinstance(fake, FakeCoordinator)
        node = StopDuring(db, config, coordinator=fake, on_promote=served.append)
        await node.start()
        await bounded(node.stop_begun.wait(), 15)
        assert node.stopping is not None
        await bounded(node.stopping, 15)
        assert served == [] and node.primary is None and node._serving is None
        assert fake.holder is None
        assert [decision.action for decision in node.decisions] == ["stopped"], node.decisions

    asyncio.run(main())
    db.close()
    messages = [record.getMessage() for record in caplog.records]
    assert not any("now primary" in message for message in messages), messages
    assert not any(record.levelno >= logging.ERROR for record in caplog.records), messages
    assert any("the broker stops: the promotion ended, the lease is released" in message for message in messages)


def test_the_address_is_handed_to_the_primary_end_before_the_store_is_loaded(tmp_path: Path) -> None:
    """docs/replication.md (Promoting a backup by hand): a PROMOTE during the store's load is
    answered by the primary end, "it is the primary already" (the docs said the address was
    handed over once the store was loaded)."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        on_promote = SlowLoad()
        node = ReplicationNode(db, config, on_promote=on_promote)
        await node.start()
        try:
            assert node.answer(Frame.PROMOTE)["promoted"] is True
            await bounded(on_promote.loading.wait(), 15)
            answer = await bounded(ask(config.listen, Frame.PROMOTE), 15)
            assert answer == {"promoted": False, "why": "it is the primary already"}, answer
        finally:
            on_promote.loaded.set()
            await bounded(node.stop(), 15)

    asyncio.run(main())
    db.close()


class Steps(ReplicationNode):
    """Records each step of a promotion that changes the node (the backup end stopped, the
    tools closed)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.steps: list[str] = []

    async def _stop_following(self) -> None:
        if self._promoting:
            self.steps.append("stop following")
        await super()._stop_following()

    async def _close_admin(self) -> None:
        if self._promoting:
            self.steps.append("close the tools")
        await super()._close_admin()


def test_a_promotion_of_a_primary_is_refused_before_any_step(tmp_path: Path) -> None:
    """PromotionRefusedError leaves the node unchanged, as errors.py says: a primary's promotion
    is refused before any step. Before: it was refused only after stopping the backup end and
    closing the tools."""
    db = backup_store(tmp_path)

    async def main() -> None:
        config, _ = node_config("the operator")
        config = ReplicationConfig(name="p", role="primary", listen=config.listen)
        node = Steps(db, config)
        await node.start()
        try:
            assert node.primary is not None and node.steps == ["stop following", "close the tools"]
            node.steps.clear()
            with pytest.raises(PromotionRefusedError, match="a primary end serves already"):
                await bounded(node.promote(), 15)
            assert node.steps == [], node.steps
            status = await bounded(ask(config.listen, Frame.STATUS), 15)
            assert status["role"] == "primary" and "promotion_failed" not in status, status
        finally:
            await bounded(node.stop(), 15)

    asyncio.run(main())
    db.close()
