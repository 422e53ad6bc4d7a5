"""A node's replication address across role changes, over real sockets and real stores: a
promotion hands the bound address from the backup's tools to the primary end instead of
closing it and binding it again, so another process that grabs the port at that moment gets
nothing (before: the promotion failed and the tools' listener stayed closed for good); a
promotion that fails after the tools stopped answering leaves a backup whose tools answer
again and show why it failed; with a coordinator the lease is given back."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from replication_helpers import bounded, primary_store
from test_replication_ha import Clock, FakeCoordinator

from amqtt_durable.process import free_port
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Coordinator
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.position import position_op
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask, format_status, split_address

HOST = "127.0.0.1"


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
            try:
                sock.bind(split_address(self.config.listen))
                sock.listen()
            except OSError as exc:
                sock.close()
                self.refused = exc
            else:
                self.squatter = sock


async def wait_role(listen: str, role: str) -> dict[str, object]:
    """Ask the node's tools until it answers with ``role`` (bounded by the caller)."""
    while True:
        status = await ask(listen, Frame.STATUS)
        if status["role"] == role:
            return status
        await asyncio.sleep(0.02)  # polling a real process's answer, not synchronising on time


@pytest.mark.parametrize("by", ["the operator", "the lease"])
def test_a_port_grabbed_as_the_promotion_starts_gets_nothing_and_the_node_serves(tmp_path: Path, by: str) -> None:
    db, _ = primary_store(tmp_path / "b")
    db.put(*position_op(0, 0))

    async def main() -> None:
        listen = f"{HOST}:{free_port()}"
        coordinator: Coordinator | None = None
        if by == "the operator":
            config = ReplicationConfig(name="b", role="backup", primary=f"{HOST}:{free_port()}", listen=listen)
        else:
            config = ReplicationConfig(name="b", role="auto", listen=listen, coordinator=["http://127.0.0.1:1"],
                                       lease_ttl=10, loop_wait=0.1, demote_margin=1.0)
            coordinator = FakeCoordinator(Clock(), ttl=10.0)  # a new cluster: this node claims its bootstrap
        served: list[Primary] = []
        replication = Squatted(db, config, coordinator=coordinator, on_promote=served.append)
        await replication.start()
        try:
            if by == "the operator":
                answer = await bounded(ask(listen, Frame.PROMOTE), 15)
                assert answer["promoted"] is True, answer
            status = await bounded(wait_role(listen, "primary"), 15)
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
    db, _ = primary_store(tmp_path / "b")
    db.put(*position_op(0, 0))

    async def main() -> None:
        listen = f"{HOST}:{free_port()}"
        coordinator: FakeCoordinator | None = None
        if by == "the operator":
            config = ReplicationConfig(name="b", role="backup", primary=f"{HOST}:{free_port()}", listen=listen)
        else:
            config = ReplicationConfig(name="b", role="auto", listen=listen, coordinator=["http://127.0.0.1:1"],
                                       lease_ttl=10, loop_wait=0.1, demote_margin=1.0)
            coordinator = FakeCoordinator(Clock(), ttl=10.0)
        tried = asyncio.Event()

        def on_promote(primary: Primary) -> None:
            tried.set()
            raise OSError(98, "Address already in use")

        replication = ReplicationNode(db, config, coordinator=coordinator, on_promote=on_promote)
        await replication.start()
        try:
            if by == "the operator":
                assert (await bounded(ask(listen, Frame.PROMOTE), 15))["promoted"] is True
            await bounded(tried.wait(), 15)

            async def failure_shown() -> dict[str, object]:
                while True:
                    status = await ask(listen, Frame.STATUS)
                    if "promotion_failed" in status:
                        return status
                    await asyncio.sleep(0.02)  # polling the node's tools

            status = await bounded(failure_shown(), 15)
            assert status["role"] == "backup" and replication.primary is None
            assert "Address already in use" in str(status["promotion_failed"])
            assert "its last promotion failed: [Errno 98] Address already in use" in format_status(status)
            if coordinator is not None:
                assert any("released the lease, still a backup" in d.reason for d in replication.decisions)
        finally:
            await replication.stop()

    asyncio.run(main())
    db.close()
