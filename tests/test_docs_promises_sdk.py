"""Promises of docs/sdk.md and docs/protocol.md (the SDK's API and the control requests' refusals)
that no other test states, each against a real broker.

Each test names the page and the promise it checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import Broker, Client
from durable_client import DurableClient
from durable_client.protocol import CONTROL_TOPIC, REPLY_TOPIC


@pytest.fixture
def sdk_clients() -> Iterator[Callable[..., DurableClient]]:
    made: list[DurableClient] = []

    def make(port: int, client_id: str, **kwargs: Any) -> DurableClient:
        client = DurableClient(client_id, port=port, reconnect_min_delay=0.05, reconnect_max_delay=0.5, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close(keep_session=True)


def raw_request(client: Client, payload: bytes) -> dict[str, Any]:
    """Publish ``payload`` on the control topic as it is; the next reply, as JSON."""
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY_TOPIC)
    client.paho.publish(CONTROL_TOPIC, payload, qos=0)
    assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY_TOPIC) > seen), "no reply"
    reply: dict[str, Any] = json.loads([m.payload for m in client.messages if m.topic == REPLY_TOPIC][seen])
    return reply


# ------------------------------------------------------------------------------ protocol.md


@pytest.mark.parametrize(
    "case",
    [
        ({"op": "hello", "req": 3}, "unsupported_version", "hello", 3),  # `v` missing
        ({"v": "1", "op": "hello", "req": 4}, "unsupported_version", "hello", 4),  # `v` not the number 1
        ({"v": 2, "op": "hello", "req": 5}, "unsupported_version", "hello", 5),
        ({"v": 1, "req": 6}, "unknown_op", None, 6),  # `op` missing
        ({"v": 1, "op": "explode", "req": 7}, "unknown_op", None, 7),
        ({"v": 1, "op": "interest", "req": 8}, "malformed", "interest", 8),  # a field the op needs
        ({"v": 1, "op": "hello", "req": "9"}, "malformed", None, None),  # `req` not an integer
    ],
)
def test_a_request_without_v_or_op_is_refused_as_the_protocol_page_says(
    broker: Broker,
    clients: Callable[..., Client],
    case: tuple[dict[str, Any], str, str | None, int | None],
) -> None:
    """protocol.md, Requests and Replies: `v` missing or not 1 is `unsupported_version`, `op`
    missing or unknown is `unknown_op`, a missing field the op needs is `malformed`; the
    refusal echoes `req` and a known `op`, both null when `req` is not an integer."""
    request_fields, code, op, req = case
    client = clients(broker.port, "proto-refusals")
    reply = raw_request(client, json.dumps(request_fields).encode())
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert (reply["op"], reply["req"]) == (op, req), reply
    assert client.paho.is_connected(), "a refused request leaves the connection up"
