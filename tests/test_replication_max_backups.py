"""replication.max_backups against a real primary broker: fake backups (raw sockets saying HELLO)
take the places, one more is refused with an ERROR frame naming the cap and closed (refused again
past the gate's 10 s, its name gets no second WARNING within the minute), the backup already in
sync stays so and publishes keep being acknowledged; silent connections take no place; a backup's
reconnection under its name is not refused; a real backup refused for the cap shows why and joins
once a place is free (docs/replication.md, How many backups)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable

import pytest
from test_ha_brokers import BACKUP, SERVING, address, node, start, wait_status

from amqtt_durable.replication.framing import NAME_IN_USE, TOO_MANY_BACKUPS, Frame, Hello, encode_frame
from amqtt_durable.replication.gate import LOG_EVERY, LOG_PER_HOST
from amqtt_durable.replication.primary import CAP_LINE
from conftest import WAIT, Broker, Client, run_cli

pytestmark = pytest.mark.timeout(180)

CAP = 2
FLOOD = 30


def connect(broker: Broker) -> socket.socket:
    host, port = address(broker).rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT)


def fake(broker: Broker, name: str, instance: int) -> socket.socket:
    """A connection to ``broker``'s replication address that says HELLO as backup ``name`` (an empty store)."""
    sock = connect(broker)
    sock.sendall(encode_frame(Frame.HELLO, Hello(0, 0, 0, name, instance=instance).encode()))
    return sock


def first_kind(sock: socket.socket) -> Frame:
    """The kind of the first frame the primary answers (its first byte)."""
    first = sock.recv(1)
    assert first, "closed without a frame"
    return Frame(first[0])


def until_closed(sock: socket.socket) -> bytes:
    """Everything the primary sends until it closes the connection (bounded by WAIT)."""
    received, deadline = b"", time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # a replaced link is aborted
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"not closed within {WAIT} s: {received[:200]!r}")


def acknowledged(primary: Broker, text: bytes) -> bool:
    """A QoS 1 publish to a durable session gets its PUBACK (sync mode: once the in-sync backup has it)."""
    publisher = Client(primary.port, "publisher", clean_session=True)
    try:
        info = publisher.paho.publish("t/x", text, qos=1)
        info.wait_for_publish(WAIT)
        return info.is_published()
    finally:
        publisher.disconnect()


def states(status: dict[str, object]) -> list[tuple[str, str]]:
    return sorted((row["name"], row["state"]) for row in status["backups"])  # type: ignore[attr-defined, index]


def test_one_backup_past_max_backups_is_refused_the_others_serve_on_and_a_freed_place_is_taken(
    broker_factory: Callable[..., Broker],
) -> None:
    primary = start(node(broker_factory, "p", role="primary", max_backups=CAP), SERVING)
    subscriber = Client(primary.port, "device")  # a durable session: each publish to it is stored
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    # Silent connections (no HELLO) take no place: counted at the HELLO, not at the accept.
    silent = [connect(primary) for _ in range(CAP + 1)]
    b = start(node(broker_factory, "b", role="backup", primary=address(primary)), BACKUP)
    wait_status(primary, lambda s: states(s) == [("b", "in_sync")])
    fake1 = fake(primary, "fake1", instance=7)
    assert first_kind(fake1) == Frame.SNAP_BEGIN  # the second place
    wait_status(primary, lambda s: len(s["backups"]) == CAP)

    extra = fake(primary, "extra", instance=8)
    refusal = f"{TOO_MANY_BACKUPS} {CAP} (backup extra refused; it retries)"
    assert until_closed(extra) == encode_frame(Frame.ERROR, refusal.encode()), "not refused for the cap"
    assert primary.wait_until(lambda: refusal in primary.log(), WAIT), primary.log()
    [line] = [line for line in primary.log().splitlines() if refusal in line]
    assert " WARNING " in line and "refused a connection from 127.0.0.1:" in line, line
    assert line.endswith(f"{refusal}; {CAP_LINE}"), line
    shown = wait_status(primary, lambda s: len(s["backups"]) == CAP)
    assert ("b", "in_sync") in states(shown) and "extra" not in str(shown["backups"])
    assert acknowledged(primary, b"past the cap")

    # A flood of HELLOs past the cap, each under another name: each refused and counted, few lines logged.
    began = time.monotonic()
    for n in range(FLOOD):
        text = f"{TOO_MANY_BACKUPS} {CAP} (backup flood{n} refused; it retries)"
        with fake(primary, f"flood{n}", instance=100 + n) as sock:
            assert until_closed(sock) == encode_frame(Frame.ERROR, text.encode())
    lasted = time.monotonic() - began  # each refusal was logged (or not) before its connection closed
    after = wait_status(primary, lambda s: s["refused"] >= shown["refused"] + FLOOD)
    # The same backups, b still in sync (fake1 reads nothing: its state moves from snapshot to catching_up
    # on its own, as its snapshot fits in the socket buffers).
    assert [name for name, _ in states(after)] == [name for name, _ in states(shown)], "the flood took a place"
    assert ("b", "in_sync") in states(after), "the flood disturbed the backup in sync"
    lines = [line for line in primary.log().splitlines() if f"{TOO_MANY_BACKUPS} {CAP} (backup flood" in line]
    # At most LOG_PER_HOST lines an interval: the flood spans two when it is quick, one more per LOG_EVERY it lasts.
    intervals = 2 + int(lasted // LOG_EVERY)
    assert 0 < len(lines) <= intervals * LOG_PER_HOST, (lasted, lines)
    # A name whose line the gate left out (its bounds for the address spent): its minute not started.
    unlogged = next(n for n in range(FLOOD) if not any(f"(backup flood{n} refused" in line for line in lines))
    assert acknowledged(primary, b"after the flood")

    # The same broker process reconnecting under its name takes its old link's place, never refused.
    again = fake(primary, "fake1", instance=7)
    assert first_kind(again) == Frame.SNAP_BEGIN, "a reconnection under the same name was refused"
    until_closed(fake1)  # the old connection is closed by the primary
    assert sorted(name for name, _ in states(status_of(primary))) == ["b", "fake1"]

    # Another process under a served name while the cap is full: refused for its name, which is checked first.
    clash = until_closed(fake(primary, "fake1", instance=9))
    assert NAME_IN_USE.encode() in clash and TOO_MANY_BACKUPS.encode() not in clash, clash
    assert sorted(name for name, _ in states(status_of(primary))) == ["b", "fake1"]

    # A real backup refused for the cap says why, and joins once a place frees.
    c = start(node(broker_factory, "c", role="backup", primary=address(primary)), BACKUP)
    refused = wait_status(c, lambda s: TOO_MANY_BACKUPS in s.get("refused_by_primary", ""))
    assert not refused["caught_up"]
    said = f"refused by the primary: {TOO_MANY_BACKUPS} {CAP} (backup c refused; it retries)"
    assert c.wait_until(lambda: said in c.log(), WAIT), c.log()
    logged = f"channel to {address(primary)} refused (retried every 5 s, this line at most once a minute): {said}"
    assert any(" WARNING " in line for line in c.log().splitlines() if logged in line), c.log()
    assert said in run_cli("inspect", "--replication", address(c)).stdout
    assert acknowledged(primary, b"while c is refused")
    again.close()
    joined = "accepted by the primary: a place among its backups is free"
    assert c.wait_until(lambda: joined in c.log(), 5 + WAIT), c.log()
    assert any(" INFO " in line for line in c.log().splitlines() if joined in line), c.log()
    wait_status(primary, lambda s: states(s) == [("b", "in_sync"), ("c", "in_sync")])
    assert "refused_by_primary" not in wait_status(c, lambda s: s["caught_up"])
    assert acknowledged(primary, b"after c joined")

    # extra refused again for the cap (b and c hold it) within the minute, once the gate's interval of
    # its first line has ended (the gate would log it again): no second line for that name.
    past_the_gate_interval(primary, after["refused"])
    with fake(primary, "extra", instance=8) as sock:
        assert until_closed(sock) == encode_frame(Frame.ERROR, refusal.encode()), "not refused for the cap"
    assert [line for line in primary.log().splitlines() if refusal in line] == [line]
    # The name the gate left out is refused again within its minute: logged now, counting the one left out.
    text = f"{TOO_MANY_BACKUPS} {CAP} (backup flood{unlogged} refused; it retries)"
    with fake(primary, f"flood{unlogged}", instance=100 + unlogged) as sock:
        assert until_closed(sock) == encode_frame(Frame.ERROR, text.encode())
    assert primary.wait_until(lambda: text in primary.log(), WAIT), primary.log()
    [again_line] = [line for line in primary.log().splitlines() if text in line]
    assert again_line.endswith(f"{text}; {CAP_LINE}, 1 more since the last line"), again_line
    for sock in [*silent, extra, fake1]:
        sock.close()
    b.stop()
    c.stop()


def past_the_gate_interval(primary: Broker, refused: int) -> None:
    """Wait for the gate's summary counting ``refused`` refusals since start, or more: the interval
    they fell in (its lines of each address and reason) ended. Where none comes, a burst of names
    past the gate's lines per address has one summed up."""
    for burst in range(3):
        if primary.wait_until(lambda: summed_up(primary, refused), LOG_EVERY + WAIT):  # noqa: B023
            return
        for n in range(LOG_PER_HOST + 1):
            with fake(primary, f"burst{burst}-{n}", instance=1000 + n) as sock:
                until_closed(sock)
        refused = status_of(primary)["refused"]  # type: ignore[assignment]
    raise AssertionError(f"no summary of the refusals: {primary.log()}")


def summed_up(primary: Broker, refused: int) -> bool:
    """A summary of the gate counting at least ``refused`` refusals since start is logged."""
    return any(int(n) >= refused for n in re.findall(r"since start (\d+) refused", primary.log()))


def status_of(broker: Broker) -> dict[str, object]:
    return wait_status(broker, lambda s: True)
