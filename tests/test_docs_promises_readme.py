"""Promises of README.md, docs/guarantees.md and docs/protocol.md that no other test states,
each against a real broker (a sentence-by-sentence audit of those pages).

Each test names the page and the promise it checks; a black-box reader of the docs would
expect exactly what is asserted here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from conftest import Broker, Client
from durable_client.protocol import REPLY_TOPIC

# ------------------------------------------------------------------------------ protocol.md


def next_reply(client: Client, topic: str, payload: bytes) -> dict[str, Any]:
    """Publish ``payload`` on ``topic`` as it is; the next reply, as JSON."""
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY_TOPIC)
    client.paho.publish(topic, payload, qos=0)
    assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY_TOPIC) > seen), "no reply"
    reply: dict[str, Any] = json.loads([m.payload for m in client.messages if m.topic == REPLY_TOPIC][seen])
    return reply


@pytest.mark.parametrize("version", [True, 1.0, 1.5, None], ids=["true", "1.0", "1.5", "null"])
def test_a_v_that_is_not_the_integer_1_is_unsupported_version(
    broker: Broker, clients: Callable[..., Client], version: object
) -> None:
    """protocol.md, Requests: "`v` (required): the protocol version, 1. A request without it, or
    with any other value, is refused with `unsupported_version`". JSON `true` and `1.0` are other
    values (a Python `==` took them for 1: `req` is already refused as `1.0` or `true`)."""
    client = clients(broker.port, "proto-version")
    reply = next_reply(client, "_durable/v1/ctl", json.dumps({"v": version, "op": "ready", "req": 5}).encode())
    assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (
        False,
        "unsupported_version",
        "ready",
        5,
    ), reply
    assert next_reply(client, "_durable/v1/ctl", b'{"v": 1, "op": "ready", "req": 6}')["ok"] is True


@pytest.mark.parametrize(
    ("payload", "op", "req"),
    [
        (b'{"v": 1, "op": "end_session", "req": 21}', "end_session", 21),
        (b'{"v": 1, "op": "fly", "req": 22}', None, 22),  # not a known op: null, as for unknown_op
        (b'{"v": 1, "op": "hello", "req": "23"}', None, None),
        (b"not json", None, None),
    ],
    ids=["readable", "unknown-op", "req-not-integer", "not-json"],
)
def test_a_request_on_another_control_topic_echoes_what_could_be_read(
    broker: Broker, clients: Callable[..., Client], payload: bytes, op: str | None, req: int | None
) -> None:
    """protocol.md: "A PUBLISH under `_durable/` other than `_durable/v1/ctl` gets the error
    `unknown_topic`", and Replies: only a request too large, not a JSON object, or whose `req` is
    not an integer is answered with `op` and `req` null; "otherwise a refusal echoes `req`, and
    `op` when it names a known op". The request is refused whole: the session stays."""
    client = clients(broker.port, "proto-topic")
    reply = next_reply(client, "_durable/v1/other", payload)
    assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (False, "unknown_topic", op, req), reply
    hello = next_reply(client, "_durable/v1/ctl", b'{"v": 1, "op": "hello", "req": 1}')
    assert hello["ok"] is True and hello["epoch"] is not None, "end_session on another topic did nothing"
