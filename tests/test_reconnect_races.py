"""Two connections of one client id racing through CONNECT: only the newest may own the session.

amqtt runs each connection's set-up (CONNACK, handler start, message loop, where the plugin
attaches the session's pump) as its own task, so an older connection of a client id (taken
over, or closed right after its CONNECT, as a device that gave up on a stalled link does) can
reach the message loop after the newer one has attached. It must not take the session: that
stopped the live connection's pump, and the old connection's end then marked the session
disconnected, leaving the live device connected, answered to PINGREQ, and sent nothing again
while its queue grew (found by the fleet harness: device restart + stall + broker kill).

The broker test holds the older connection before its message loop with a small test plugin,
which makes that interleaving certain instead of a matter of scheduling.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly
from test_protocol import request

from amqtt_durable.config import DurableConfig
from amqtt_durable.delivery import AckKind
from amqtt_durable.engine import DurableEngine
from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads
from durable_client import DurableClient

GATE_PLUGIN = '''
import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

from amqtt.plugins.base import BasePlugin

HOLD_LIMIT = 60.0


class ConnectionGate(BasePlugin):
    """Test plugin: orders the set-up of connections by their CONNECT's username (its role).

    * ``held``: its message loop (where the durable plugin attaches) starts once a connection with
      client id ``release-after-held`` enters its own; that one's loop, which answers its
      SUBSCRIBE, waits until the held connection's loop (attach, run, detach) has ended.
    * ``first`` / ``first-late`` and ``second``: two connections of one client id. ``first`` gets
      its CONNACK (the broker answers CONNECTs of one client id one at a time) and enters its
      message loop once ``second``'s CONNECT is read; ``second`` waits for a connection with
      client id ``release`` (its CONNACK, and its take-over of ``first``, come after that);
      ``first-late`` enters its message loop only after ``second`` has entered its own.
    * ``end-held``: the end of the first such connection to end is held right after amqtt has
      handled it (its Session counts as disconnected, its socket is closed), before the rest of
      its message loop's end (the durable plugin's detach), until a connection with client id
      ``release-after-held`` enters its message loop (which then waits until that end has run);
      logs "held the end of a connection" as the hold begins.
    """

    @dataclass
    class Config:
        pass

    async def on_broker_post_start(self) -> None:
        broker = self.context._broker_instance
        initialize, message_loop = broker._initialize_client_session, broker._client_message_loop
        handle_disconnect = broker._handle_disconnect
        events = defaultdict(asyncio.Event)
        end_held = []

        async def wait(name):
            await asyncio.wait_for(events[name].wait(), HOLD_LIMIT)

        async def initialize_client_session(*args):
            handler, session = await initialize(*args)
            handler.gate_role = role = session.username  # read now: a take-over overwrites it
            if role == "second":
                events["second read"].set()
                await wait("release")
            return handler, session

        async def handle_disconnect_held(session, handler, disconnect_waiter):
            await handle_disconnect(session, handler, disconnect_waiter)
            if getattr(handler, "gate_role", None) == "end-held" and not end_held:
                end_held.append(handler)
                logging.getLogger("connection_gate").warning("held the end of a connection")
                await wait("release")

        async def client_message_loop(session, handler):
            role = getattr(handler, "gate_role", None)
            if role == "held":
                try:
                    await wait("release")
                    await message_loop(session, handler)
                finally:
                    events["held done"].set()
                return
            if role in ("first", "first-late"):
                await wait("second read")
            if role == "first-late":
                await wait("second loop")
            elif role == "second":
                events["second loop"].set()
            elif session.client_id == "release":
                events["release"].set()
            elif session.client_id == "release-after-held":
                events["release"].set()
                await wait("held done")
            try:
                await message_loop(session, handler)
            finally:
                if end_held and handler is end_held[0]:
                    events["held done"].set()

        broker._initialize_client_session = initialize_client_session
        broker._client_message_loop = client_message_loop
        broker._handle_disconnect = handle_disconnect_held
'''


def gated_broker(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, *, ws: bool = False
) -> tuple[Broker, Client]:
    """A broker with GATE_PLUGIN (recovery_buffer 10; any user may take a session over: roles are
    usernames; ``ws``: a websocket listener too) and durable session dev subscribed to race/t (QoS 1),
    disconnected: (broker, dev)."""
    (tmp_path / "connection_gate.py").write_text(GATE_PLUGIN)
    broker = broker_factory(start=False, recovery_buffer=10, session_takeover="any-user")
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["connection_gate.ConnectionGate"] = {}
    if ws:
        broker.ws_port = free_port()
    broker.start()
    device = clients(broker.port, "dev")
    assert device.subscribe("race/t", 1) == [1]
    device.disconnect()
    return broker, device


@pytest.mark.timeout(120)
def test_an_older_connection_reaching_its_message_loop_late_leaves_the_session_to_the_newer(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    broker, device = gated_broker(broker_factory, clients, tmp_path)
    publisher = clients(broker.port, "pub", clean_session=True)
    queued = payloads(40, "q")
    publisher.publish("race/t", queued, qos=1)

    # The older connection: its CONNECT is accepted (CONNACK), its message loop is held.
    older = raw_connect(broker.port, "dev", clean=False, username="held")
    # The newer one takes the session over (amqtt closes the older) and gets the queue.
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(len(queued))] == queued

    # Let the older connection run its message loop; the SUBACK of the releasing connection comes
    # once that loop (its attach, its end, its detach) is over.
    release = raw_connect(broker.port, "release-after-held", clean=True)
    assert raw_subscribe(release, "release/none", 0) == 0, "no SUBACK"
    release.close()
    older.close()

    live = payloads(30, "live")
    publisher.publish("race/t", live, qos=1)
    received = [m.payload for m in device.wait_messages(len(queued) + len(live))]
    assert received[len(queued) :] == live, (
        f"the live connection got {len(received) - len(queued)} of {len(live)} messages published after the "
        f"older connection's message loop ran"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("older", ["first", "first-late"])
def test_an_older_connection_left_open_by_amqtt_is_ended_when_a_later_connect_takes_the_session(
    older: str, broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """After a broker restart amqtt has no Session to share: two CONNECTs of one client id read at
    the same time got one each and neither was taken over. The later CONNECT has the session; the
    older connection must be ended (MQTT-3.1.4-2) so that its client reconnects, rather than stay
    connected and be sent nothing: ``first`` has attached when the later one attaches,
    ``first-late`` attaches after it. (CONNECTs of one client id are now answered one at a time,
    so the later one finds the older in amqtt's table and takes it over.)"""
    broker, _ = gated_broker(broker_factory, clients, tmp_path)
    queued = payloads(40, "q")
    clients(broker.port, "pub-1", clean_session=True).publish("race/t", queued, qos=1)
    broker.restart(kill=True)

    device = clients(broker.port, "dev", username=older, auto_start=False)
    connecting = threading.Thread(target=device.connect)
    connecting.start()
    connecting.join(WAIT)
    assert device.session_present is True, "the older connection got no CONNACK"
    later = socket.create_connection((HOST, broker.port), timeout=WAIT)
    body = mqtt_string("MQTT") + bytes([4, 0x80, 0, 60]) + mqtt_string("dev") + mqtt_string("second")
    later.sendall(mqtt_packet(0x10, body))  # read: the older one's message loop goes on
    if older == "first":
        assert [m.payload for m in device.wait_messages(len(queued))] == queued

    release = raw_connect(broker.port, "release", clean=True)
    assert read_exactly(later, 4) == b"\x20\x02\x01\x00", "the later connection got no CONNACK"
    assert device.wait_disconnected(), "the older connection stayed open without the session: connected, sent nothing"
    later.close()
    release.close()

    device.paho.loop_stop()
    assert device.connect() is True
    live = payloads(30, "live")
    clients(broker.port, "pub-2", clean_session=True).publish("race/t", live, qos=1)
    assert device.wait_for(lambda ms: ms and ms[-1].payload == live[-1])
    got = list(dict.fromkeys(m.payload for m in device.messages))  # QoS 1: a redelivery may repeat one
    assert got == queued + live


def test_connections_closed_right_after_their_connect_end_and_their_sessions_expire(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Found with the test above: a client that sends CONNECT and closes at once left its EOF for
    the reader, which ended before amqtt's handler start made the disconnect waiter; nothing
    resolved it, so the connection's message loop never ended (its listener slot held) and its
    durable session never detached: with session_expiry 0 it never expired (present on the next
    CONNECT). Each must end, and each session expire."""
    broker = broker_factory(session_expiry=0)
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/expired", 1)
    ids = [f"gone-{n}" for n in range(5)]
    for client_id in ids:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(connect_packet(client_id, clean=False))
    assert watcher.wait_for(lambda ms: {json.loads(m.payload)["client_id"] for m in ms} >= set(ids)), (
        f"expired: {[json.loads(m.payload)['client_id'] for m in watcher.messages]}"
    )
    assert clients(broker.port, ids[0]).session_present is False


class Recording:
    """A pump's transport that keeps the payloads of the PUBLISHes written to it."""

    def __init__(self) -> None:
        self.closed = False
        self.payloads: list[bytes] = []
        self.changed = asyncio.Event()

    def write(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):  # the pump writes whole QoS 1 PUBLISHes with short remaining lengths here
            first, length = data[pos], data[pos + 1]
            assert length < 128
            body = data[pos + 2 : pos + 2 + length]
            if first >> 4 == 3:
                topic_len = int.from_bytes(body[:2], "big")
                self.payloads.append(bytes(body[2 + topic_len + 2 :]))
            pos += 2 + length
        self.changed.set()

    async def drain(self) -> None:
        return None

    def expect_ack(self, kind: AckKind, packet_id: int, on_ack: Callable[[], None]) -> None:
        return None


@pytest.mark.timeout(60)
def test_only_the_newest_connection_gets_a_pump_when_attaches_race_over_the_commit(tmp_path: Path) -> None:
    """Both connections pass attach's first check while a commit is awaited; the older must not
    install a pump (nor leave one running beside the newer one's)."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=10))
        engine.open()
        try:
            older, newer = Recording(), Recording()
            await engine.connect("dev", clean_session=False, transport=older)
            await engine.subscribe("dev", "t", 1)
            await engine.connect("dev", clean_session=False, transport=newer)
            await asyncio.gather(engine.attach("dev", newer), engine.attach("dev", older))
            session = engine.sessions["dev"]
            assert session.transport is newer
            assert session.pump is not None and session.pump.transport is newer
            await engine.detach("dev", older)  # the older connection ends: nothing changes
            assert session.transport is newer and session.pump.transport is newer
            stored = engine.route_publish("t", b"x", 1)
            assert stored is not None
            await stored
            async with asyncio.timeout(WAIT):
                while not newer.payloads:
                    newer.changed.clear()
                    await newer.changed.wait()
            assert newer.payloads == [b"x"]
            assert older.payloads == []
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_connect_right_after_a_connection_closed_at_its_connect_gets_its_connack(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """A device that sends CONNECT and closes at once (it gave up), then connects again with the
    same client id: the second CONNECT takes the first over inside amqtt's CONNECT handling, often
    before the first connection's reader task has run. amqtt's take-over cancels that task and
    waited for an event only the task's body sets, so the second connection never got a CONNACK
    (every round hung until the client's own timeout). It must get CONNACK 0 with session present,
    and the session's messages."""
    connect = mqtt_string("MQTT") + bytes([4, 0x00, 0, 60])  # clean_session=false, keep-alive 60 s
    publisher = clients(broker.port, "pub", clean_session=True)
    for round_ in range(5):
        client_id = f"gave-up-{round_}"
        device = clients(broker.port, client_id)
        device.subscribe("gave/up", 1)
        device.disconnect()
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as first:
            first.sendall(mqtt_packet(0x10, connect + mqtt_string(client_id)))
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as second:
            second.sendall(mqtt_packet(0x10, connect + mqtt_string(client_id)))
            assert read_exactly(second, 4) == b"\x20\x02\x01\x00", f"round {round_}: no CONNACK"
            publisher.publish("gave/up", [f"r{round_}".encode()])
            header = read_exactly(second, 2)
            body = read_exactly(second, header[1])
            assert header[0] & 0xF0 == 0x30 and body.endswith(f"r{round_}".encode()), (header, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["disconnect", "take-over", "websocket-disconnect", "websocket-take-over"])
def test_a_non_durable_subscription_ends_with_its_connection_whatever_order_its_end_and_the_next_attach_run_in(
    end: str, broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """docs/protocol.md, `interest`: "`durable: false` makes that filter's subscription
    non-durable: the broker drops it when the connection that sent it ends". The end of the connection that made
    it (a DISCONNECT, or a take-over by a new CONNECT of its client id) is held after amqtt has
    handled it, before the durable plugin's detach (GATE_PLUGIN's ``end-held``: a loaded broker, in which
    the newer connection's attach runs first). The newer connection's hello lists the session's
    subscriptions without it, and a non-durable subscription the newer connection makes is still
    there once the older connection's end has run. Before the fix neither the attach nor the older
    connection's detach (the session no longer its) dropped it: it outlived the connection for good."""
    websocket = end.startswith("websocket-")
    broker, _ = gated_broker(broker_factory, clients, tmp_path, ws=websocket)
    port = broker.ws_port if broker.ws_port is not None else broker.port
    transport = "websockets" if websocket else "tcp"
    older = clients(port, "held", username="end-held", transport=transport)
    assert request(older, "hello").ok
    assert older.subscribe([("held/keep", 1), ("held/older", 1)]) == [1, 1]
    assert request(older, "interest", filter="held/older", durable=False).ok
    if end.endswith("disconnect"):
        older.disconnect()
        assert broker.wait_until(lambda: "held the end of a connection" in broker.log(), WAIT), broker.log()[-2000:]
    newer = clients(port, "held", username="end-held", transport=transport)
    assert newer.session_present is True
    if end.endswith("take-over"):
        assert older.wait_disconnected(), "the older connection was not ended"
        assert broker.wait_until(lambda: "held the end of a connection" in broker.log(), WAIT), broker.log()[-2000:]
    assert request(newer, "hello").fields["subscriptions"] == {"held/keep": 1}, "outlived its connection"
    assert newer.subscribe("held/newer", 1) == [1]
    assert request(newer, "interest", filter="held/newer", durable=False).ok

    release = clients(broker.port, "release-after-held", clean_session=True)
    assert release.subscribe("release/none", 0) == [0], "no SUBACK"  # once the older connection's end has run
    assert request(newer, "hello").fields["subscriptions"] == {"held/keep": 1, "held/newer": 1}
    assert request(newer, "ready").ok
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("held/older", [b"older"])
    publisher.publish("held/newer", [b"newer"])
    publisher.publish("held/keep", [b"keep"])
    assert newer.wait_for(lambda ms: any(m.topic == "held/keep" for m in ms))
    assert [m.topic for m in newer.messages if m.topic.startswith("held/")] == ["held/newer", "held/keep"]


@pytest.mark.timeout(120)
def test_a_subscription_made_durable_again_while_disconnected_survives_the_older_connections_late_end(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """The SDK, subscribe(durable=True) of a filter made non-durable, while not connected: the
    broker's session holds the filter non-durable, made so by an older connection of the client id
    that this CONNECT takes over and whose end runs late (GATE_PLUGIN's ``end-held``). The SDK's
    ``interest durable: true`` goes before its hello; the subscription is there, durable, once the
    older connection's end has run. (amqtt's take-over closes the older connection before the
    durable plugin sees this CONNECT, which then ends the filter: this passes without the SDK's
    request too. The broker still counting the older connection open at the CONNECT, where the
    hello listed the filter and the SDK sent nothing, is tests/unit/test_sdk_client.py's
    ``..._says_so_before_the_hello`` and test_replay_marker.py's ``..._marks_again_...``.)"""
    broker, _ = gated_broker(broker_factory, clients, tmp_path)
    older = clients(broker.port, "sdk-held", username="end-held")
    assert older.subscribe([("again/t", 1), ("again/keep", 1)]) == [1, 1]
    assert request(older, "interest", filter="again/t", durable=False).ok
    got: queue.Queue[tuple[str, bytes]] = queue.Queue()
    device = DurableClient("sdk-held", port=broker.port)
    try:
        device.subscribe("again/t", qos=1, durable=False, listener=lambda e: got.put((e.topic, e.payload)))
        device.subscribe("again/t", qos=1, listener=lambda e: got.put((e.topic, e.payload)))  # durable again
        device.subscribe("again/keep", qos=1, listener=lambda e: got.put((e.topic, e.payload)))
        device.ready_for_events()
        device.connect(timeout=WAIT)  # takes the session over from the older connection
        assert older.wait_disconnected(), "the older connection was not ended"
        assert broker.wait_until(lambda: "held the end of a connection" in broker.log(), WAIT), broker.log()[-2000:]
        release = clients(broker.port, "release-after-held", clean_session=True)
        assert release.subscribe("release/none", 0) == [0], "no SUBACK"  # once the older connection's end has run
        publisher = clients(broker.port, "pub", clean_session=True)
        publisher.publish("again/t", [b"durable"])
        publisher.publish("again/keep", [b"keep"])
        first = got.get(timeout=WAIT)
        assert first == ("again/t", b"durable"), "the subscription ended with the older connection"
    finally:
        device.close(keep_session=False)
