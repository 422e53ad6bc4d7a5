"""max_stream_entries_per_client: a connection's open stream filters plus the positions it presented
for topics without a log are bounded; a stream_subscribe past it is refused and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from test_streams import make_logs, put, run

from amqtt_durable.stream_sender import StreamSender
from durable_client.protocol import ProtocolError
from recording_transport import RecordingTransport


def test_filters_and_kept_positions_count_against_the_limit_and_a_refusal_changes_nothing(db: Any) -> None:
    logs, committer = make_logs(db)
    put(logs, committer, "s/exists")

    async def body() -> None:
        transport = RecordingTransport()
        sender = StreamSender(logs, transport, default_window=1, ack_timeout=60.0, max_entries=4, client_id="c")
        await sender.subscribe("s/a", {"s/exists": 0, "s/b": 3})  # s/b matches no filter here: not kept
        await sender.subscribe("s/#", {"s/exists": 0, "s/x": 5, "s/y": 6})  # s/exists has a log: not kept
        assert sender._filters.keys() == {"s/a", "s/#"} and sender._pending_after == {"s/x": 5, "s/y": 6}
        await sender.subscribe("s/#", {"s/x": 7})  # a held filter and a kept position count once
        assert sender._pending_after == {"s/x": 7, "s/y": 6}
        with pytest.raises(ProtocolError, match=r"hold 5 stream filters .* the limit is 4") as refused:
            await sender.subscribe("s/c")
        assert refused.value.code == "malformed"
        with pytest.raises(ProtocolError, match="hold 5"):
            await sender.subscribe("s/#", {"s/z": 1})
        assert sender._filters.keys() == {"s/a", "s/#"} and sender._pending_after == {"s/x": 7, "s/y": 6}
        sender.unsubscribe("s/#")  # its positions go with it
        await sender.subscribe("s/c", {"s/c": 1})
        sender.stop()

    run(body)


def test_no_limit_with_zero(db: Any) -> None:
    logs, _ = make_logs(db)

    async def body() -> None:
        sender = StreamSender(logs, RecordingTransport(), default_window=1, ack_timeout=60.0, max_entries=0)
        await sender.subscribe("s/#", {f"s/{i}": 1 for i in range(5000)})
        assert len(sender._pending_after) == 5000
        sender.stop()

    run(body)
