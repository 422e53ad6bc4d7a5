"""Limits at the door against a real broker process over TCP: ``max_durable_sessions`` (a client
cycling fresh client ids with clean_session=false must not grow the store and the broker's memory
without bound) and ``max_connections_per_address`` (docs/operations.md, "What a client may hold,
and its limits"; docs/configuration.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly
from replication_helpers import cluster_pki
from test_hostile_owner import PASSWORDS, REFUSED, acl_broker
from test_hostile_owner import raw_connect as owner_connect
from test_hostile_review_conn import broker_with_two_connection_slots
from test_hostile_wire import publish_packet, read_until_closed
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from amqtt_durable.inspect_store import summarize
from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, queued_while_dropped
from durable_client import ConnectFailed, DurableClient

SYS = "$SYS/broker/durable/"
PROBES = itertools.count()
LIMIT_LINE = "refused (CONNACK 3, server unavailable): the store holds max_durable_sessions"


def connack_codes(port: int, client_ids: list[str], *, at_once: bool) -> dict[str, int]:
    """CONNECT (clean_session=false) with each client id, each on its own socket; the return code
    of each CONNACK. ``at_once``: every CONNECT is sent before any CONNACK is read, so the broker
    reads them in the same passes of its loop. A refused connection must be closed by the broker;
    an accepted one is closed by this client after its CONNACK."""
    socks = {client_id: socket.create_connection((HOST, port), timeout=WAIT) for client_id in client_ids}
    codes: dict[str, int] = {}
    try:
        if at_once:
            for client_id, sock in socks.items():
                sock.sendall(connect_packet(client_id, clean=False))
        for client_id, sock in socks.items():
            if not at_once:
                sock.sendall(connect_packet(client_id, clean=False))
            connack = read_exactly(sock, 4)
            assert connack[:2] == b"\x20\x02", connack
            codes[client_id] = connack[3]
            if connack[3]:
                assert connack[2] == 0, f"a refusal has no session present: {connack!r}"
                assert read_until_closed(sock, WAIT) == b"", f"{client_id}: refused but left open"
    finally:
        for sock in socks.values():
            sock.close()
    return codes


def latest(client: Client, name: str) -> int | None:
    values = [int(m.payload) for m in client.messages if m.topic == SYS + name]
    return values[-1] if values else None


def attack(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], *, at_once: bool
) -> None:
    limit, extra = 8, 6
    broker = broker_factory(max_durable_sessions=limit, metrics_interval=0.2)
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe(SYS + "#", 0)
    queued = payloads(5)
    device, publisher = queued_while_dropped(clients, broker.port, "q/#", "q/1", queued)  # one session held
    attackers = [f"attacker-{i:03d}" for i in range(limit + extra)]
    codes = connack_codes(broker.port, attackers, at_once=at_once)
    accepted = sorted(c for c, code in codes.items() if code == 0)
    refused = sorted(c for c, code in codes.items() if code == 3)
    assert len(accepted) == limit - 1 and len(refused) == extra + 1, codes
    # The durable session that was there reconnects with its queue; a publisher is still served.
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(len(queued))] == queued
    publisher.publish("q/1", [b"after"], qos=1)
    assert device.wait_for(lambda messages: messages[-1].payload == b"after")
    assert watcher.wait_for(lambda _: latest(watcher, "sessions/refused") == extra + 1), broker.log()
    assert clients(broker.port, "clean-newcomer", clean_session=True).connect_reason == 0, "clean: not counted"
    log = broker.log()
    assert log.count(LIMIT_LINE) == 1, "one WARNING per drop_log_interval (10 s)"
    assert f"max_durable_sessions ({limit}) durable sessions" in log
    assert "Failed to initialize client session" not in log and "Error while handling client session" not in log
    broker.stop()
    assert {row.client_id for row in summarize(broker.store)} == {"dev-1", *accepted}


def test_a_loop_of_fresh_durable_client_ids_gets_exactly_the_free_slots_the_rest_connack_3(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    attack(broker_factory, clients, at_once=False)


def test_durable_connects_read_at_once_past_the_limit_create_exactly_the_free_slots(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    attack(broker_factory, clients, at_once=True)


def test_a_clean_connect_and_an_expiry_free_a_slot(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(max_durable_sessions=2, session_expiry=1)
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe(SYS + "expired", 1)
    keeper = raw_connect(broker.port, "keeper", clean=False)  # connected: never expires
    clients(broker.port, "short").disconnect()  # expires 1 s after this
    assert connack_codes(broker.port, ["third"], at_once=False) == {"third": 3}
    assert watcher.wait_for(lambda messages: any(b'"short"' in m.payload for m in messages))
    assert connack_codes(broker.port, ["third"], at_once=False) == {"third": 0}, "expiry freed a slot"
    assert connack_codes(broker.port, ["fourth"], at_once=False) == {"fourth": 3}
    keeper.close()
    assert clients(broker.port, "keeper", clean_session=True).session_present is False  # ends its session
    assert connack_codes(broker.port, ["fourth"], at_once=False) == {"fourth": 0}, "a clean CONNECT freed one"


def test_the_count_after_a_restart_is_the_stores(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(max_durable_sessions=2)
    device, _ = queued_while_dropped(clients, broker.port, "q/#", "q/1", [b"kept"])
    assert connack_codes(broker.port, ["other"], at_once=False) == {"other": 0}
    broker.kill()
    broker.start()
    assert connack_codes(broker.port, ["newcomer"], at_once=False) == {"newcomer": 3}
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(1)] == [b"kept"]
    assert connack_codes(broker.port, ["other"], at_once=False) == {"other": 0}, "an existing session reconnects"


def refused_round(broker: Broker, watcher: Client, live: socket.socket) -> bool:
    """One place free: a durable CONNECT of X (whose clean connection ``live`` is served) and of six
    newcomers, all sent before any CONNACK is read, X's connection opened last and its CONNECT sent
    first. Whether X's was refused; its connection is closed by the broker then (checked)."""
    ids = [f"new-{i}" for i in range(6)]
    socks = {cid: socket.create_connection((HOST, broker.port), timeout=WAIT) for cid in [*ids, "X"]}
    try:
        for cid, sock in reversed(list(socks.items())):
            sock.sendall(connect_packet(cid, clean=False, will_topic=b"w/" + cid.encode()))
        codes = {cid: read_exactly(sock, 4)[3] for cid, sock in socks.items()}
        assert sorted(codes.values()) == [0] + [3] * 6, codes
        if codes["X"]:
            assert read_until_closed(socks["X"], WAIT) == b"", "refused but left open"
        return codes["X"] != 0
    finally:
        for sock in socks.values():
            sock.close()


def test_a_durable_connect_refused_by_the_limit_leaves_the_live_connection_of_its_client_id_alone(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """MQTT 3.1.4: a take-over only for an accepted CONNECT. The place is decided as the CONNECT is
    read: one refused then never reached amqtt's take-over of X's live connection (which ended it,
    deleted its subscriptions and published no will) before losing the place at its CONNACK."""
    for _ in range(5):  # X's CONNECT, sent last, loses the one place (else a new broker and again)
        broker = broker_factory(max_durable_sessions=2)
        watcher = clients(broker.port, "watch", clean_session=True)
        watcher.subscribe("w/#", 0)
        keeper = raw_connect(broker.port, "keeper", clean=False)  # one session of two
        live = socket.create_connection((HOST, broker.port), timeout=WAIT)
        live.sendall(connect_packet("X", clean=True, will_topic=b"w/X"))
        assert read_exactly(live, 4) == b"\x20\x02\x00\x00"
        assert raw_subscribe(live, "x/#", 0) == 0
        if refused_round(broker, watcher, live):
            break
        keeper.close()
        live.close()
        broker.stop()
    else:
        pytest.fail("X's CONNECT won the place in every round")
    live.sendall(bytes((0xC0, 0)))  # PINGREQ
    assert read_exactly(live, 2) == b"\xd0\x00", "the live connection of X is still served"
    clients(broker.port, "pub", clean_session=True).publish("x/1", [b"still"], qos=0)
    expected = publish_packet(b"x/1", b"still", 0)
    assert read_exactly(live, len(expected)) == expected, "and keeps its subscription"
    clients(broker.port, "pub2", clean_session=True).publish("w/marker", [b"m"], qos=0)
    assert watcher.wait_for(lambda messages: messages[-1].topic == "w/marker")
    assert "w/X" not in [m.topic for m in watcher.messages], "no will of X published"
    assert "performing take-over" not in broker.log()
    keeper.close()
    live.close()


def test_connections_from_one_address_past_the_limit_are_closed_before_anything_is_read(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(max_connections_per_address=3, metrics_interval=0.2)
    watcher = clients(broker.port, "ops", clean_session=True)  # one of the three
    watcher.subscribe(SYS + "connections/refused", 0)
    held = [raw_connect(broker.port, f"held-{i}", clean=True) for i in range(2)]
    for _ in range(3):
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            assert read_until_closed(sock, WAIT) == b"", "closed at once, nothing sent"
    leaving = held.pop()
    leaving.sendall(bytes((0xE0, 0)))  # DISCONNECT; the broker's close of it is its end there
    assert read_until_closed(leaving, WAIT) == b""
    leaving.close()
    held.append(raw_connect(broker.port, "again", clean=True))  # a closed connection freed its place
    assert watcher.wait_for(lambda _: latest(watcher, "connections/refused") == 3), broker.log()
    log = broker.log()
    assert log.count("closing a new connection from 127.0.0.1 before reading anything") == 1, log
    assert "max_connections_per_address (3)" in log
    for sock in held:
        sock.close()


def test_a_connection_past_the_address_limit_does_not_wait_for_a_listener_slot(
    broker_factory: Callable[..., Broker],
) -> None:
    """configuration.md: closed before it takes a place among its listener's max_connections.
    amqtt's own limit would keep it accepted but unread until a connection ends."""
    broker = broker_with_two_connection_slots(broker_factory, max_connections_per_address=2)
    held = [raw_connect(broker.port, f"held-{i}", clean=True) for i in range(2)]  # both slots taken
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        assert read_until_closed(sock, WAIT) == b"", "closed at once, not left waiting for a slot"
    for sock in held:
        sock.close()


def tls_broker(
    broker_factory: Callable[..., Broker], tmp_path: Path, **settings: object
) -> tuple[Broker, int, ssl.SSLContext]:
    """A broker with a TLS listener too (a certificate for 127.0.0.1); the broker, the TLS
    listener's port and a client context that trusts it."""
    pki = cluster_pki(tmp_path)
    broker = broker_factory(start=False, **settings)
    broker.tls = (free_port(), pki["node"])
    broker.start()
    return broker, broker.tls[0], ssl.create_default_context(cafile=pki["ca"])


def tls_connect(port: int, context: ssl.SSLContext, client_id: str) -> ssl.SSLSocket:
    """A clean CONNECT over TLS; the connection, once CONNACK accepted it."""
    sock = context.wrap_socket(socket.create_connection((HOST, port), timeout=WAIT), server_hostname=HOST)
    sock.sendall(connect_packet(client_id, clean=True))
    assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    return sock


def answer_to_client_hello(port: int, context: ssl.SSLContext) -> bytes | None:
    """What the broker sends back to a TLS ClientHello before it closes the connection (b"":
    nothing, not even a ServerHello), or None if the connection is still open."""
    hello = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), hello, server_hostname=HOST)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        with contextlib.suppress(ConnectionError):  # closed already
            sock.sendall(hello.read())
        return read_until_closed(sock, WAIT)


def test_a_tls_connection_past_the_address_limit_is_closed_before_its_tls_handshake(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """configuration.md: a TCP connection past max_connections_per_address is closed as soon as it
    is accepted, on a TLS listener before its TLS handshake (no cryptography for it: it was done
    first, a full handshake per refused connection). TLS and plain TCP connections share an
    address's count; a TLS connection's end, a failed handshake's included, gives its place back."""
    broker, tls_port, context = tls_broker(broker_factory, tmp_path, max_connections_per_address=2)
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the start-up check's connection has ended"
    held_tls = tls_connect(tls_port, context, "held-tls")
    held_tcp = raw_connect(broker.port, "held-tcp", clean=True)
    for _ in range(3):
        assert answer_to_client_hello(tls_port, context) == b"", "closed at once: no ServerHello, no handshake"
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        assert read_until_closed(sock, WAIT) == b"", "a plain TCP one past the limit: closed at once"
    held_tls.close()
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the TLS connection's end freed its place"
    with socket.create_connection((HOST, tls_port), timeout=WAIT) as failing:  # not TLS: its handshake fails
        failing.sendall(connect_packet("not-tls", clean=True))
        assert read_until_closed(failing, WAIT) is not None, "a failed handshake ends the connection"
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the failed handshake's end freed its place"
    tls_connect(tls_port, context, "again").close()
    log = broker.log()
    assert log.count("closing a new connection from 127.0.0.1 before reading anything") == 1, log
    held_tcp.close()


def test_a_broker_stopped_with_connections_before_their_connect_logs_no_error(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """operations.md ("Ctrl-C or SIGTERM shuts it down cleanly"): SIGTERM while connections wait, on the TLS listener in
    their TLS handshake (a silent one, one with half a ClientHello) and on the plain one for their
    CONNECT, stops the broker cleanly, with no ERROR: each such connection's task was cancelled,
    which asyncio logged as an ERROR with a CancelledError traceback, one per connection."""
    broker, tls_port, _ = tls_broker(broker_factory, tmp_path, max_connections_per_address=3)
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the start-up check's connection has ended"
    with (
        socket.create_connection((HOST, tls_port), timeout=WAIT),
        socket.create_connection((HOST, tls_port), timeout=WAIT) as half_hello,
        socket.create_connection((HOST, broker.port), timeout=WAIT),
    ):
        half_hello.sendall(b"\x16\x03\x01\x00\x50")  # a handshake record's header; the record never comes
        assert broker.wait_until(lambda: not place_free(broker.port), WAIT), "the three are counted"
        broker.stop()
    assert broker.exit_status == 0, broker.log()
    log = broker.log()
    for bad in ("Traceback", "Task was destroyed", "Unhandled exception", " ERROR "):
        assert bad not in log, log


def place_free(port: int) -> bool:
    """A new TCP connection from 127.0.0.1 gets CONNACK 0 (it then ends with a DISCONNECT)."""
    try:
        with socket.create_connection((HOST, port), timeout=WAIT) as sock:
            sock.sendall(connect_packet(f"probe-{next(PROBES)}", clean=True))
            if sock.recv(4) != b"\x20\x02\x00\x00":
                return False
            sock.sendall(bytes((0xE0, 0)))
            read_until_closed(sock, WAIT)
            return True
    except OSError:
        return False


def websocket_connack(ws_port: int, client_id: str, *, keepalive: int = 60, disconnect: bool = True) -> bytes:
    """CONNECT over a websocket connection; its CONNACK (the connection is then closed here, after
    a DISCONNECT if ``disconnect``). Raises websockets' InvalidStatus when the upgrade is refused."""

    async def run() -> bytes:
        async with ws_connect(f"ws://{HOST}:{ws_port}/", subprotocols=["mqtt"]) as ws:  # type: ignore[list-item]
            await ws.send(connect_packet(client_id, clean=True, keepalive=keepalive))
            connack = bytes(await asyncio.wait_for(ws.recv(), WAIT))  # type: ignore[arg-type]
            if disconnect:
                await ws.send(bytes((0xE0, 0)))
            return connack

    return asyncio.run(run())


def test_a_websocket_upgrade_past_the_address_limit_gets_http_503_and_is_never_upgraded(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md: on a websocket listener the upgrade request is read, and one past the limit is
    answered HTTP 503 instead of 101; TCP and websocket connections share an address's count."""
    broker = broker_factory(start=False, max_connections_per_address=2)
    broker.ws_port = free_port()
    broker.start()
    held_ws = clients(broker.ws_port, "held-ws", clean_session=True, transport="websockets")
    held_tcp = raw_connect(broker.port, "held-tcp", clean=True)
    for _ in range(3):
        with pytest.raises(InvalidStatus) as refused:
            websocket_connack(broker.ws_port, "past")
        assert refused.value.response.status_code == 503
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        assert read_until_closed(sock, WAIT) == b"", "a TCP one past the limit: closed at once"
    held_ws.disconnect()
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the websocket connection's end freed its place"
    assert websocket_connack(broker.ws_port, "again") == b"\x20\x02\x00\x00"
    log = broker.log()
    assert log.count("answering the websocket upgrade request of a new connection from 127.0.0.1 with HTTP 503") == 1
    held_tcp.close()


def test_every_end_of_a_websocket_connection_gives_its_address_place_back(
    broker_factory: Callable[..., Broker],
) -> None:
    broker = broker_factory(start=False, max_connections_per_address=1, max_keepalive=60)
    broker.ws_port = free_port()
    broker.start()
    assert broker.wait_until(lambda: place_free(broker.port), WAIT)
    ends = [
        lambda: websocket_connack(broker.ws_port, "ws", disconnect=True) == b"\x20\x02\x00\x00",
        lambda: websocket_connack(broker.ws_port, "ws", disconnect=False) == b"\x20\x02\x00\x00",
        lambda: websocket_connack(broker.ws_port, "ws", keepalive=0, disconnect=False) == b"\x20\x02\x00\x02",
        lambda: plain_http_get(broker.ws_port).startswith(b"HTTP/1.1 426"),  # the upgrade fails after its check
    ]
    for end in ends:
        for _ in range(3):
            assert end()
            assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the address is locked out"


def plain_http_get(port: int) -> bytes:
    """A GET without an upgrade to the websocket listener: the broker's answer, read to its close."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return read_until_closed(sock, WAIT) or b""


def test_a_connection_waiting_for_a_listener_slot_counts_until_the_broker_sees_it_closed(
    broker_factory: Callable[..., Broker],
) -> None:
    """configuration.md: one waiting for a max_connections place counts too, also when its client has
    closed it meanwhile (the broker sees that once it has its place and reads it)."""
    broker = broker_with_two_connection_slots(broker_factory, max_connections_per_address=3)
    held = [raw_connect(broker.port, f"held-{i}", clean=True) for i in range(2)]  # both slots taken
    waiting = socket.create_connection((HOST, broker.port), timeout=WAIT)  # the third: waits for a slot
    waiting.close()
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        assert read_until_closed(sock, WAIT) == b"", "the closed waiting connection still counts"
    leaving = held.pop()
    leaving.sendall(bytes((0xE0, 0)))  # DISCONNECT: its slot goes to the waiting one, which is seen closed
    assert read_until_closed(leaving, WAIT) == b""
    leaving.close()
    held.append(raw_connect(broker.port, "next", clean=True))  # the slot the closed one gave back
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as third:  # counted: 3 of 3, waits
        third.sendall(connect_packet("third", clean=True))
        held[0].sendall(bytes((0xE0, 0)))
        assert read_exactly(third, 4) == b"\x20\x02\x00\x00", "the closed one no longer counts"
    for sock in held:
        sock.close()


def test_a_half_open_connection_holds_its_address_place_until_the_keepalive_check_closes_it(
    broker_factory: Callable[..., Broker],
) -> None:
    """operations.md: a device whose old connection is half-open (silent: the broker cannot tell) cannot
    reconnect from the same address past a small limit until 1.5 times the keep-alive closes it."""
    broker = broker_factory(max_connections_per_address=1)
    assert broker.wait_until(lambda: place_free(broker.port), WAIT), "the start-up check's connection has ended"
    old = raw_connect(broker.port, "device", clean=False, keepalive=1)  # then silent, as a half-open one
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        assert read_until_closed(sock, WAIT) == b"", "the device's reconnect is closed at once"
    assert read_until_closed(old, WAIT) == b"", "closed by the broker after 1.5 s of silence"
    assert broker.wait_until(lambda: place_free(broker.port), WAIT)
    device = raw_connect(broker.port, "device", clean=False)
    device.close()
    old.close()


def connack_of(port: int, client_id: str, keepalive: int, *, clean: bool = True) -> bytes:
    """The CONNACK a CONNECT with this keep-alive gets (a refused one's connection must be closed by
    the broker); the connection is closed here."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(connect_packet(client_id, clean=clean, keepalive=keepalive))
        connack = read_exactly(sock, 4)
        if connack[3]:
            assert read_until_closed(sock, WAIT) == b"", "refused but left open"
        return connack


def test_max_keepalive_refuses_keepalive_0_and_above_it_with_connack_2(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(max_keepalive=60)
    assert connack_of(broker.port, "none", 0) == b"\x20\x02\x00\x02"
    assert connack_of(broker.port, "long", 61) == b"\x20\x02\x00\x02"
    assert connack_of(broker.port, "long", 65535) == b"\x20\x02\x00\x02"
    assert connack_of(broker.port, "fine", 60) == b"\x20\x02\x00\x00"
    assert connack_of(broker.port, "short", 1) == b"\x20\x02\x00\x00"
    assert connack_of(broker.port, "dev", 0, clean=False) == b"\x20\x02\x00\x02", "a durable CONNECT too"
    assert clients(broker.port, "dev").session_present is False, "nothing was created for the refused one"
    log = broker.log()
    assert log.count("refused (CONNACK 2, identifier rejected): its keep-alive is 0 s") == 1, log
    assert "max_keepalive (60)" in log
    assert "Failed to initialize client session" not in log


def test_keepalive_0_is_accepted_by_default(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    assert connack_of(broker.port, "none", 0) == b"\x20\x02\x00\x00"
    assert connack_of(broker.port, "longest", 65535) == b"\x20\x02\x00\x00"


def test_an_sdk_end_session_frees_a_slot_and_a_new_sdk_session_past_the_limit_fails_connect(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: without failover a CONNACK 3 at connect() fails at once (ConnectFailed); configuration.md:
    end_session frees a place."""
    broker = broker_factory(max_durable_sessions=1)
    holder = sdk(broker.port, "holder")
    holder.connect(timeout=WAIT)
    newcomer = sdk(broker.port, "newcomer")
    with pytest.raises(ConnectFailed, match="Server unavailable"):
        newcomer.connect(timeout=WAIT)
    holder.close(keep_session=False)  # end_session
    sdk(broker.port, "newcomer").connect(timeout=WAIT)


def test_an_sdk_client_with_failover_goes_round_its_list_until_a_place_frees(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md / replication.md: CONNACK 3 from a broker at max_durable_sessions moves a client with
    failover on round its list (here a dead address) and back, until a place frees."""
    broker = broker_factory(max_durable_sessions=1)
    holder = raw_connect(broker.port, "holder", clean=False)
    client = sdk(broker.port, "roaming", failover=[(HOST, free_port())])
    connecting = threading.Thread(target=client.connect, kwargs={"timeout": 4 * WAIT})
    connecting.start()
    try:
        assert broker.wait_until(lambda: "client id 'roaming' refused (CONNACK 3" in broker.log(), WAIT)
        holder.close()
        assert clients_free_a_place(broker.port, "holder")
    finally:
        connecting.join(4 * WAIT)
    assert not connecting.is_alive()
    assert client.connected and client.port == broker.port


def clients_free_a_place(port: int, client_id: str) -> bool:
    """A clean CONNECT of ``client_id`` ends its durable session (the connection is closed here)."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(connect_packet(client_id, clean=True))
        return read_exactly(sock, 4) == b"\x20\x02\x00\x00"


SLOW_AUTH = '''
import asyncio
from pathlib import Path

from amqtt.plugins.base import BaseAuthPlugin

ENTERED = Path({entered!r})
GATE = Path({gate!r})
RESULT = {result!r}


class SlowAuth(BaseAuthPlugin):
    """A slow authentication backend (an HTTP or LDAP call): user "slow" waits until the test opens
    the gate (bounded), then gets RESULT; everyone else is accepted at once."""

    async def authenticate(self, *, session):
        if session.username != "slow":
            return True
        ENTERED.write_text("1")
        for _ in range(600):
            if GATE.exists():
                break
            await asyncio.sleep(0.05)
        return RESULT
'''


def slow_auth_broker(
    broker_factory: Callable[..., Broker], tmp_path: Path, result: bool, **settings: object
) -> tuple[Broker, Path, Path]:
    """A broker with SlowAuth (user "slow" gets ``result`` once the gate file exists); the broker,
    the file SlowAuth writes when it starts checking, and the gate file."""
    entered, gate = tmp_path / "entered", tmp_path / "gate"
    (tmp_path / "slow_auth.py").write_text(SLOW_AUTH.format(entered=str(entered), gate=str(gate), result=result))
    broker = broker_factory(start=False, **settings)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["slow_auth.SlowAuth"] = {}
    broker.start()
    return broker, entered, gate


def closed_at_connect_timeout(broker: Broker, entered: Path, gate: Path, connect: bytes) -> bytes:
    """Send ``connect`` (user "slow" of ``slow_auth_broker``) and wait until its credentials are
    being checked; what the broker sends before it closes the connection; then the gate opens
    (the check returns its result after the connection was closed)."""
    entered.unlink(missing_ok=True)
    gate.unlink(missing_ok=True)
    try:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(connect)
            assert broker.wait_until(entered.exists, WAIT), "its credentials are being checked"
            return read_until_closed(sock, WAIT)
    finally:
        gate.write_text("1")


def test_an_unauthenticated_connect_does_not_take_a_place_from_a_legitimate_device(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """configuration.md: max_durable_sessions is checked after the CONNECT's credentials. A CONNECT
    whose credentials are still being checked (and then fail) holds no place: a device gets in
    while the store holds fewer sessions than the limit."""
    broker, entered, gate = slow_auth_broker(broker_factory, tmp_path, False, max_durable_sessions=1)
    attacker = socket.create_connection((HOST, broker.port), timeout=WAIT)
    try:
        attacker.sendall(connect_packet("attacker", clean=False, username="slow"))
        assert broker.wait_until(entered.exists, WAIT), "the attacker's CONNECT is being authenticated"
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as device:
            device.sendall(connect_packet("device", clean=False))
            connack = read_exactly(device, 4)
        assert connack == b"\x20\x02\x00\x00", f"the store holds 0 of 1 sessions, yet the device got {connack!r}"
        gate.write_text("1")
        assert read_exactly(attacker, 4) == b"\x20\x02\x00\x05", "the attacker is refused (CONNACK 5)"
    finally:
        gate.write_text("1")
        attacker.close()


def bad_login(port: int, client_id: str) -> bytes:
    """A durable CONNECT with a wrong password; the broker's answer."""
    body = mqtt_string("MQTT") + bytes([4, 0xC0, 0, 60]) + mqtt_string(client_id)  # username, password
    body += mqtt_string("alice") + mqtt_string(PASSWORDS["alice"] + "-wrong")
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        return read_exactly(sock, 4)


def test_no_ending_between_read_and_connack_leaks_a_place(broker_factory: Callable[..., Broker]) -> None:
    """Every way a durable CONNECT's connection ends before its CONNACK gives its place back: a will
    topic the ACL refuses, a wrong password, a reset right after the CONNECT."""
    broker = acl_broker(broker_factory, max_durable_sessions=1, publish_acl={"bob": ["bob/#"]})
    for i in range(5):
        assert owner_connect(broker.port, f"will-{i}", "bob", will=True) == REFUSED  # will topic refused
        assert bad_login(broker.port, f"bad-{i}") == REFUSED  # amqtt's own authentication
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:  # reset after the CONNECT
            sock.sendall(connect_packet(f"reset-{i}", clean=False))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    for i in range(5):  # a reset CONNECT may have been handled whole (a session): a clean CONNECT ends it
        assert clients_free_a_place(broker.port, f"reset-{i}")
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("final", clean=False))
        ok = read_exactly(sock, 4)
    assert ok == b"\x20\x02\x00\x00", f"a leaked reservation holds the only place: {ok!r}"


def test_a_new_durable_connect_still_authenticating_at_connect_timeout_is_closed_without_connack(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """configuration.md, connect_timeout: a CONNECT whose credentials are checked as it is read (one
    that would create a durable session) must have them checked within connect_timeout, or its
    connection is closed with no CONNACK; it holds no place (max_durable_sessions 1)."""
    broker, entered, gate = slow_auth_broker(broker_factory, tmp_path, False, max_durable_sessions=1, connect_timeout=1)
    connect = connect_packet("slow-device", clean=False, username="slow")
    assert closed_at_connect_timeout(broker, entered, gate, connect) == b"", "closed at connect_timeout, no CONNACK"
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as device:
        device.sendall(connect_packet("device", clean=False))
        assert read_exactly(device, 4) == b"\x20\x02\x00\x00"


def test_a_connect_closed_at_connect_timeout_creates_no_session_and_publishes_no_will(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """configuration.md connect_timeout: a CONNECT whose credentials are checked as it is read and
    not by then has its connection closed with no CONNACK, and nothing of it is acted on even if its
    credentials pass later: no durable session (the $SYS count stays 0), no will published."""
    broker, entered, gate = slow_auth_broker(
        broker_factory, tmp_path, True, connect_timeout=1, max_durable_sessions=5, metrics_interval=0.2
    )
    watcher = clients(broker.port, "watcher", clean_session=True)
    watcher.subscribe([("will/#", 0), (SYS + "sessions/disconnected", 0), (SYS + "sessions/connected", 0)])
    connect = connect_packet("late", clean=False, username="slow", will_topic=b"will/late")
    assert closed_at_connect_timeout(broker, entered, gate, connect) == b"", "closed at connect_timeout, no CONNACK"
    # The credentials now pass; a session or a will would show within a few metrics intervals.
    watcher.wait_for(lambda ms: any(m.topic == "will/late" or _held(m) for m in ms), 3)
    assert [m.topic for m in watcher.messages if m.topic == "will/late"] == [], "its will was published"
    assert [m.payload for m in watcher.messages if _held(m)] == [], "a durable session was created"
    # Its place was never taken: max_durable_sessions 5 still admits five devices.
    for i in range(5):
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as device:
            device.sendall(connect_packet(f"device-{i}", clean=False))
            assert read_exactly(device, 4) == b"\x20\x02\x00\x00"


def _held(message: mqtt.MQTTMessage) -> bool:
    """A $SYS sessions count above 0 (a durable session exists)."""
    return message.topic.startswith(SYS + "sessions/") and int(message.payload) > 0


def test_a_take_over_closed_at_connect_timeout_does_not_end_the_live_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """configuration.md connect_timeout: a CONNECT that takes over a connected client id has its
    credentials checked as it is read, or its connection is closed with no CONNACK; once closed,
    its credentials passing later must not end the live connection (clean and durable CONNECTs)."""
    broker, entered, gate = slow_auth_broker(broker_factory, tmp_path, True, connect_timeout=1)
    live = clients(broker.port, "tk", clean_session=True)
    for clean in (True, False):
        connect = connect_packet("tk", clean=clean, username="slow")
        assert closed_at_connect_timeout(broker, entered, gate, connect) == b"", "closed at connect_timeout, no CONNACK"
        assert not live.wait_disconnected(3), f"a CONNECT (clean={clean}) closed at connect_timeout ended it"
    publisher = clients(broker.port, "pub", clean_session=True)
    assert live.subscribe("t/#", 1) == [1]
    publisher.publish("t/1", [b"hello"], qos=1)
    assert live.wait_for(lambda ms: any(m.topic == "t/1" for m in ms), 5), "the live connection gets nothing"
