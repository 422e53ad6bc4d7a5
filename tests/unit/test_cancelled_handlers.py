"""A handler the plugin's reader cancels at its connection's end (``FastReader.run``): what it
raises on the cancel is logged unless it is amqtt's ProtocolHandlerError, which amqtt makes of the
cancel of a handler waiting to write (no broker needed: real asyncio tasks)."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

import pytest
from amqtt.errors import ProtocolHandlerError

from amqtt_durable.amqtt_glue import _cancelled_by_the_end


async def handler(started: asyncio.Event, raised: BaseException | None) -> None:
    """Waits until cancelled, then raises ``raised`` (None: the cancel itself)."""
    started.set()
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        if raised is None:
            raise
        raise raised from None


async def cancelled_at_the_end(raised: BaseException | None) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(handler(started, raised))
    await started.wait()
    task.cancel()
    task.add_done_callback(partial(_cancelled_by_the_end, "dev"))
    await asyncio.wait([task])
    return task


def test_any_other_error_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="amqtt_durable"):
        asyncio.run(cancelled_at_the_end(RuntimeError("boom")))
    assert "dev: a handler cancelled at the connection's end failed: RuntimeError('boom')" in caplog.text


@pytest.mark.parametrize(
    "raised", [ProtocolHandlerError("Packet handling was cancelled"), None], ids=["amqtt's", "cancel"]
)
def test_the_cancel_and_amqtts_error_of_it_are_not(
    caplog: pytest.LogCaptureFixture, raised: BaseException | None
) -> None:
    with caplog.at_level(logging.DEBUG):
        task = asyncio.run(cancelled_at_the_end(raised))
    assert task.cancelled() == (raised is None)
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
