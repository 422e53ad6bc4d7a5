"""Connections of one client id that end or overlap around their CONNACK (review 301).

A websocket client that closes before its CONNACK, and CONNECTs of one client id read while a
take-over waits for the older connection (up to 5 s): MQTT-3.1.4-2, the newest connection wins and
every older one is closed; a session none of them keeps expires like any disconnected one.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

from raw_mqtt_helpers import connect_packet, read_exactly
from test_hostile_amqtt_sessions import PROBE_PLUGIN, StuckWebsocket, amqtt_table
from test_recovery_and_crash import EXPIRED_TOPIC

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client

CONNACK_ACCEPTED = b"\x20\x02\x00\x00"


def expired_ids(messages: list) -> set[str]:  # type: ignore[type-arg]
    return {json.loads(m.payload)["client_id"] for m in messages if m.topic == EXPIRED_TOPIC}


def connect_then_close_over_websocket(ws_port: int, client_id: str, *, clean: bool) -> None:
    """A CONNECT, a close frame, the socket closed, in one go: the broker's CONNACK write fails."""
    ws = StuckWebsocket(ws_port)
    ws.protocol.send_binary(connect_packet(client_id, clean=clean))
    ws.protocol.send_close()
    ws._flush()
    ws.sock.close()


def test_durable_websocket_connections_closed_before_their_connack_expire(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """Before the fix, websockets' ConnectionClosed from the CONNACK write escaped amqtt's connection
    handling ("ERROR websockets.server: connection handler failed"): no attach, no detach, so each
    new durable session had no expiry deadline. 20 of them with max_durable_sessions 20 locked every
    new durable client out (CONNACK 3) until a restart."""
    broker = broker_factory(start=False, session_expiry=1, max_durable_sessions=20)
    broker.ws_port = free_port()
    broker.start()
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    ghosts = {f"g{i}" for i in range(20)}
    for client_id in sorted(ghosts):
        connect_then_close_over_websocket(broker.ws_port, client_id, clean=False)
    assert monitor.wait_for(lambda ms: ghosts <= expired_ids(ms), 4 * WAIT), (
        sorted(ghosts - expired_ids(monitor.messages)),
        broker.log()[-3000:],
    )
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as late:
        late.sendall(connect_packet("late", clean=False))
        assert read_exactly(late, 4) == CONNACK_ACCEPTED, "a place of max_durable_sessions is still held"
    log = broker.log()
    assert "connection handler failed" not in log and "Traceback" not in log, log[-3000:]


def test_clean_websocket_connections_closed_before_their_connack_leave_no_amqtt_session(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """The same for clean CONNECTs: amqtt kept each one's Session "connected" in its table for ever."""
    (tmp_path / "amqtt_sessions_probe.py").write_text(PROBE_PLUGIN)
    broker = broker_factory(start=False)
    broker.ws_port = free_port()
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["amqtt_sessions_probe.AmqttSessions"] = {}
    broker.start()
    ids = {f"c{i}" for i in range(30)}
    for client_id in sorted(ids):
        connect_then_close_over_websocket(broker.ws_port, client_id, clean=True)
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    assert broker.wait_until(lambda: not ids & set(amqtt_table(monitor)), 2 * WAIT), sorted(
        ids & set(amqtt_table(monitor))
    )
    log = broker.log()
    assert "connection handler failed" not in log and "Traceback" not in log, log[-3000:]
