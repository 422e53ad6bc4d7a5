"""A backup pointed at another backup (replication.primary naming a node that is itself a backup):
the refused node says why in an ERROR frame, and the following backup logs that reason once at
WARNING, then at most once a minute (docs/replication.md, "A backup pointed at a backup"). Before, it
logged "the primary ... closed the channel" twice a second, for ever, with nothing saying why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from replication_helpers import HOST, bounded, following, new_backup
from test_ha_brokers import BACKUP, SERVING, address, node, start, wait_status

from amqtt_durable.replication.backup import REFUSAL_LOG_EVERY, Backup, _RepeatedLine
from amqtt_durable.replication.framing import NOT_PRIMARY, Frame, encode_frame
from conftest import WAIT, Broker, free_port, run_cli

pytestmark = pytest.mark.timeout(120)

RETRIES = 4
"""Tries seen refused (each a DEBUG line after the first's WARNING) before the WARNINGs are counted:
about 2 s at the backup's 0.5 s retry, far below the one minute between two WARNING lines."""


def test_a_backup_pointed_at_a_backup_is_told_why_and_says_so_once(broker_factory: Callable[..., Broker]) -> None:
    primary = start(node(broker_factory, "p", role="primary"), SERVING)
    middle = start(node(broker_factory, "m", role="backup", primary=address(primary)), BACKUP)
    wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
    chained = node(broker_factory, "c", role="backup", primary=address(middle))
    chained.argv = [*chained.argv, "-d"]  # its DEBUG lines count the tries
    start(chained, BACKUP)

    refused = f"channel to {address(middle)} refused"

    def lines(level: str) -> list[str]:
        return [line for line in chained.log().splitlines() if refused in line and f" {level} " in line]

    assert chained.wait_until(lambda: len(lines("DEBUG")) >= RETRIES, WAIT), chained.log()[-4000:]
    warnings = lines("WARNING")
    assert len(warnings) == 1, warnings
    # The reason names the problem and the node the refusing backup follows.
    reason = (
        f"{NOT_PRIMARY}: backup m (follows {address(primary)}); replication.primary must name the primary's address"
    )
    assert reason in warnings[0], warnings[0]
    assert "the primary at" not in chained.log(), "still logs that the channel was closed"

    state = wait_status(chained, lambda s: NOT_PRIMARY in s.get("refused_by_primary", ""))
    assert state["state"] == "disconnected" and state["caught_up"] is False, state
    shown = run_cli("inspect", "--replication", address(chained)).stdout
    assert reason in shown and "disconnected, not caught up" in shown, shown
    # The refusing backup goes on following its primary, undisturbed.
    wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])

    # Gone: the tries now fail to connect, and no reason of a refusal is shown any more.
    middle.stop()
    state = wait_status(chained, lambda s: "refused_by_primary" not in s)
    assert state["state"] in ("disconnected", "connecting"), state  # connecting: read as a try is under way


def test_a_long_name_does_not_hide_the_refusal(broker_factory: Callable[..., Broker]) -> None:
    """A peer's ERROR text is shown cut at 200 characters: the fixed words come first, so a refusing backup
    with a long name (300 characters here) is still recognised as no primary (retried every 0.5 s, shown
    in refused_by_primary), not taken for an unknown refusal retried every 5 s."""
    long_name = "n" * 300
    middle = broker_factory(
        start=False,
        name="long",
        replication={
            "name": long_name, "listen": f"{HOST}:{free_port()}", "role": "backup", "primary": f"{HOST}:{free_port()}"
        },
    )  # fmt: skip
    start(middle, BACKUP)
    chained = start(node(broker_factory, "c", role="backup", primary=address(middle)), BACKUP)
    state = wait_status(chained, lambda s: s.get("refused_by_primary", "").startswith(f"{NOT_PRIMARY}: backup nnn"))
    assert state["refused_by_primary"].endswith("... (cut)"), state
    assert "retried every 0.5 s" in chained.log() and "retried in 5 s" not in chained.log(), chained.log()[-3000:]


def test_a_node_that_closes_the_hello_without_a_word_is_logged_once_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier version's backup sends no ERROR frame: it closes the channel. The line says that it
    closed it before answering (is it the primary?), at WARNING once, then DEBUG while it goes on."""
    caplog.set_level(logging.DEBUG, logger="amqtt_durable.replication")

    asyncio.run(answer_hellos(tmp_path, b"", RETRIES + 1))
    closed = [r for r in caplog.records if "closed the channel before answering the HELLO" in r.getMessage()]
    assert [r.levelno for r in closed][:1] == [logging.WARNING], closed
    assert sum(r.levelno == logging.WARNING for r in closed) == 1, [r.getMessage() for r in closed]
    assert sum(r.levelno == logging.DEBUG for r in closed) >= RETRIES - 1, [r.getMessage() for r in closed]


def test_alternating_refusals_are_each_logged_at_most_once_a_minute() -> None:
    """Two reasons that alternate (a node closing the channel, then refusing as a backup, again and
    again) give one WARNING each, not one per try."""
    repeated = _RepeatedLine(REFUSAL_LOG_EVERY)
    texts = ["closed before answering", f"{NOT_PRIMARY}: backup m (follows no primary yet)"] * RETRIES
    levels = [repeated.level(text) for text in texts]
    assert levels == [logging.WARNING] * 2 + [logging.DEBUG] * (len(texts) - 2), levels


def test_a_backup_caught_up_with_a_primary_since_demoted_stays_caught_up_while_it_answers_not_primary(
    tmp_path: Path,
) -> None:
    """The last primary, demoted (cut off from etcd), answers its backup's HELLO with NOT_PRIMARY: the
    backup stays caught up with it, so the HA loop lets it take the lease (docs/replication.md: caught
    up with the last primary until a primary answers). Taken for a primary's answer, the ERROR frame
    made it not caught up, and the pair waited as after a full stop until the old primary came back
    (the fleet's partition: no failover)."""
    reason = f"{NOT_PRIMARY}: backup p (follows no primary yet); replication.primary must name the primary's address"

    backup = asyncio.run(answer_hellos(tmp_path, encode_frame(Frame.ERROR, reason.encode()), RETRIES, caught_up=True))
    assert backup.refused is not None and backup.refused.startswith(f"{NOT_PRIMARY}:"), backup.refused
    assert backup.caught_up is True


def test_a_refused_backup_shows_disconnected_while_its_next_try_waits_for_an_answer(tmp_path: Path) -> None:
    """docs/replication.md: a backup refused as no primary shows `disconnected, not caught up` and the
    reason until a try ends otherwise. Its next try, held here before the node answers, showed
    catching_up beside the last try's reason: a status read at that moment (the first test reads
    two) saw a refused backup catching up."""
    reason = f"{NOT_PRIMARY}: backup m (follows no primary yet); replication.primary must name the primary's address"

    async def main() -> None:
        held = asyncio.Event()
        release = asyncio.Event()
        connections = 0

        async def refuse_then_hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.read(1)
            if connections == 1:
                writer.write(encode_frame(Frame.ERROR, reason.encode()))
            else:
                held.set()
                await release.wait()
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(refuse_then_hold, HOST, 0)
        backup = new_backup(tmp_path, "b")
        try:
            async with following(backup, server.sockets[0].getsockname()[1]):
                await bounded(held.wait(), WAIT)
                assert (backup.state, backup.caught_up, backup.refused) == ("disconnected", False, reason)
        finally:
            release.set()
            server.close()
            await server.wait_closed()
            backup.db.close()

    asyncio.run(main())


async def answer_hellos(tmp_path: Path, answer: bytes, tries: int, caught_up: bool = False) -> Backup:
    """A backup follows a node that reads each HELLO's first byte, sends ``answer`` (nothing: an
    earlier version's backup; an ERROR frame: this version's) and closes, for ``tries`` tries. The
    backup starts caught up when ``caught_up`` (told IN_SYNC by that node while it was the primary)."""
    answered: list[float] = []
    """When each answer was sent, in seconds since the backup began to follow."""
    tried = asyncio.Condition()
    loop = asyncio.get_running_loop()

    async def answer_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(answer)
        await writer.drain()
        writer.close()
        async with tried:
            answered.append(round(loop.time() - began, 2))
            tried.notify_all()

    server = await asyncio.start_server(answer_and_close, HOST, 0)
    backup = new_backup(tmp_path, "b")
    backup.caught_up = caught_up
    began = loop.time()
    try:
        async with following(backup, server.sockets[0].getsockname()[1]), tried:
            try:
                await bounded(tried.wait_for(lambda: len(answered) >= tries), WAIT)
            except TimeoutError:  # seen once under load: say how far it got, and when (a stall, or a try stuck)
                shown = f"{len(answered)} of {tries} HELLOs answered in {WAIT} s, at {answered} s"
                raise AssertionError(f"{shown}; backup {backup.state}") from None
        return backup
    finally:
        server.close()
        await server.wait_closed()
        backup.db.close()
