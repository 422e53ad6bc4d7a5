"""Promises of docs/sdk.md and docs/protocol.md (the SDK's API and the control requests' refusals)
that no other test states, each against a real broker.

Each test names the page and the promise it checks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_sdk import Recorder

from conftest import Broker, Client
from durable_client import CacheEntry, DurableClient
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


# ------------------------------------------------------------------------------ sdk.md


def test_a_cache_entry_has_value_seq_epoch_published_at_and_state(
    broker: Broker, sdk_clients: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, The last-value cache: `cache.entry(topic)` gives value, seq, epoch, published_at
    and state; `cache.invalidate(topic)` leaves an `invalid` entry that a new subscription's
    retained (initial) value fills; an empty live payload destroys the entry; `in` and
    iteration see valid entries only."""
    connected: list[Any] = []
    recorder = Recorder()
    dashboard = sdk_clients(broker.port, "cache-entry", on_connected=connected.append)
    dashboard.subscribe("ce/a", listener=recorder)
    dashboard.connect()
    dashboard.ready_for_events()
    publisher = clients(broker.port, "pub", clean_session=True)

    before = time.time()
    publisher.publish("ce/a", [b"live-1"], retain=True)
    (event,) = recorder.wait(1)
    entry = dashboard.cache.entry("ce/a")
    assert isinstance(entry, CacheEntry)
    assert (entry.value, entry.seq, entry.epoch, entry.state) == (b"live-1", event.seq, connected[0].epoch, "valid")
    assert before - 1 <= entry.published_at <= time.time() + 1
    assert "ce/a" in dashboard.cache and list(dashboard.cache) == ["ce/a"]

    dashboard.cache.invalidate("ce/a")
    invalid = dashboard.cache.entry("ce/a")
    assert invalid is not None and (invalid.value, invalid.state) == (None, "invalid")
    assert dashboard.cache.get("ce/a") is None and "ce/a" not in dashboard.cache and list(dashboard.cache) == []

    dashboard.subscribe("ce/+", listener=recorder)  # a new subscription: the retained value comes as initial value
    assert recorder.wait_until(lambda events: any(e.retained for e in events))
    assert dashboard.cache.get("ce/a") == b"live-1", "an invalidated entry takes the initial value"

    publisher.publish("ce/a", [b""])
    assert recorder.wait_until(lambda events: events[-1].payload == b"" and not events[-1].replayed)
    destroyed = dashboard.cache.entry("ce/a")
    assert destroyed is not None and (destroyed.value, destroyed.state) == (None, "destroyed")
    assert dashboard.cache.get("ce/a") is None and "ce/a" not in dashboard.cache


@pytest.mark.parametrize("bad_filter", ["a/#/b", "a/b#", "a+/b", "a/\x00"])
def test_an_invalid_filter_is_refused_before_connect_and_connect_still_works(
    broker: Broker, sdk_clients: Callable[..., DurableClient], bad_filter: str
) -> None:
    """sdk.md, Subscriptions: subscriptions may be made before connect(). An invalid filter is
    refused there at once with ValueError, as when connected, and the client connects as usual
    (before, it was accepted and connect() failed after its timeout: paho raised on the network
    thread while sending the SUBSCRIBE)."""
    client = sdk_clients(broker.port, "early-bad-filter")
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe(bad_filter)
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe_stream(bad_filter, lambda _event: None)
    client.subscribe("fine/#")
    client.connect(timeout=5)
    assert client.connected
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe(bad_filter)
