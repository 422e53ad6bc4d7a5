"""Black-box checks, third pass, of docs/guarantees.md and docs/operations.md, written from the
documents alone: real broker processes (``amqtt-durable broker``), real paho clients and raw
sockets over TCP on 127.0.0.1, the real ``amqtt-durable inspect``, real SIGKILL, a real small
disk (tmpfs) that fills up. Each test quotes the promise it checks; the earlier passes
(test_blind_ops.py, test_blind_ops2.py, test_blind_guarantees.py, test_docs_promises*.py) cover
the others."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly, read_packet
from small_disk import fill, small_disk
from test_hostile_disk import HEALTH, acknowledging, wait_health
from test_hostile_wire import PATHS, read_until_closed

from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, queued_while_dropped, run_cli

pytestmark = pytest.mark.timeout(60)

SYS = "$SYS/broker/durable/"


def log_lines(broker: Broker, needle: str) -> list[str]:
    return [line for line in broker.log().splitlines() if needle in line]


def wait_for_log(broker: Broker, needle: str) -> list[str]:
    """The broker's log lines holding ``needle``, once there is one (bounded by WAIT)."""
    assert broker.wait_until(lambda: bool(log_lines(broker, needle)), WAIT), broker.log()[-3000:]
    return log_lines(broker, needle)


def latest_number(client: Client, topic: str) -> int | None:
    values = [int(m.payload) for m in client.messages if m.topic == topic]
    return values[-1] if values else None


def failing_writes(clients: Callable[..., Client], port: int, disk: Path, monitor: Client, topic: str) -> Path:
    """Fill ``disk`` and make the store's next write fail: a QoS 1 publish of 64 KiB on ``topic``
    (some durable session must hold a filter matching it), whose connection the broker closes
    unacknowledged. Returns once ``monitor`` (subscribed to HEALTH) saw the state 'failing', with
    the file filling the disk: unlink it to free the disk."""
    filler = fill(disk)
    trigger = clients(port, "trigger", clean_session=True)
    trigger.paho.publish(topic, bytes(64 * 1024), qos=1)
    assert trigger.wait_disconnected(), "a publish that could not be stored ends its connection"
    wait_health(monitor, "failing")
    return filler


def queued_reader(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], disk: Path, count: int, window: int
) -> tuple[Broker, Client, Client, list[bytes]]:
    """A broker whose store is on ``disk`` (in-flight window ``window``), a durable session
    holding big/# for failing_writes, and a durable reader (manual acks) connected with ``count``
    messages queued on r/t, its first window received: (broker, reader, health monitor, queued)."""
    broker = broker_factory(store=str(disk / "store"), recovery_buffer=window)
    other = clients(broker.port, "other")
    other.subscribe("big/#", 1)
    other.disconnect()
    reader = clients(broker.port, "reader", manual_ack=True)
    reader.subscribe("r/#", 1)
    reader.disconnect()
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(HEALTH, 1)
    queued = payloads(count, "r")
    clients(broker.port, "pub", clean_session=True).publish("r/t", queued)
    assert reader.connect() is True
    assert [m.payload for m in reader.wait_messages(window)] == queued[:window], "the first window"
    return broker, reader, monitor, queued


# ------------------------------------------------------------------ guarantees.md
@pytest.mark.parametrize("path", PATHS)
def test_a_pubrel_with_the_dup_flag_closes_the_connection_without_a_pubcomp(
    broker_factory: Callable[..., Broker], path: str
) -> None:
    """guarantees.md: "paho-mqtt 1.3.1 and older (Python) set DUP on a PUBREL they re-send (first
    byte 0x6A) ... The broker closes the connection at each such PUBREL (MQTT-3.6.1-1), so that
    publish never gets its PUBCOMP"; fixed header flags that are not 0010 for PUBREL close the
    connection "unanswered, on either reader ... with a WARNING naming the client". And "every
    PUBREL gets a PUBCOMP": the same packet id released properly on a new connection gets one."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    sock = raw_connect(broker.port, "old-paho", clean=False)
    sock.sendall(mqtt_packet(0x34, mqtt_string("rel/t") + b"\x00\x07" + b"exactly once"))
    assert read_packet(sock) == (0x50, b"\x00\x07"), "PUBREC of packet id 7"
    sock.sendall(b"\x6a\x02\x00\x07")
    assert read_until_closed(sock, WAIT) == b"", "closed, with no PUBCOMP"
    sock.close()
    warnings = wait_for_log(broker, "closing the connection of old-paho")
    assert all("WARNING" in line for line in warnings), warnings
    again = raw_connect(broker.port, "old-paho", clean=False)
    again.sendall(b"\x62\x02\x00\x07")
    packets = [read_packet(again)]
    if packets[0][0] == 0x50:  # the PUBREC sent again while amqtt still holds the session
        packets.append(read_packet(again))
    assert packets[-1] == (0x70, b"\x00\x07"), packets
    again.close()


def test_filters_starting_with_a_wildcard_never_match_the_brokers_own_sys_topics(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Durable session lifecycle: "Wills and broker-internal messages ($SYS/...)
    reach durable sessions through the same queue. As MQTT requires, filters starting with `+` or
    `#` do not match `$` topics": neither the metrics (QoS 0) nor the `$SYS/broker/durable/expired`
    event (QoS 1) reach a durable session's `#` or `+/...`, while `$SYS/broker/durable/#` gets both,
    each at the lower of its own QoS and the subscription's."""
    broker = broker_factory(metrics_interval=0.2, session_expiry=1)
    live = clients(broker.port, "hash-live")
    assert live.subscribe([("#", 1), ("+/broker/durable/#", 1), ("+/+/+/expired", 1)]) == [1, 1, 1]
    sys_reader = clients(broker.port, "sys-reader")
    assert sys_reader.subscribe(SYS + "#", 2) == [2]
    sys_q0 = clients(broker.port, "sys-q0")
    assert sys_q0.subscribe(SYS + "expired", 0) == [0]
    gone = clients(broker.port, "gone")
    gone.subscribe("gone/t", 1)
    gone.disconnect()
    expired = SYS + "expired"
    assert sys_reader.wait_for(
        lambda ms: any(m.topic == expired and json.loads(m.payload)["client_id"] == "gone" for m in ms)
    ), "the expiry event of 'gone'"
    assert sys_reader.wait_for(lambda ms: any(m.topic == SYS + "sessions/connected" for m in ms)), "a metric"
    assert sys_q0.wait_for(lambda ms: any(m.topic == expired for m in ms))
    # guarantees.md: "Delivered QoS = min(publish QoS, subscription QoS)", "`$SYS` messages too"
    # (the event is published at QoS 1, the metrics at QoS 0).
    assert {m.qos for m in sys_reader.messages if m.topic == expired} == {1}
    assert {m.qos for m in sys_reader.messages if m.topic != expired} == {0}
    assert {m.qos for m in sys_q0.messages} == {0}
    clients(broker.port, "pub", clean_session=True).publish("fence/t", [b"fence"])
    assert live.wait_for(lambda ms: any(m.payload == b"fence" for m in ms))
    assert [m.topic for m in live.messages] == ["fence/t"]


def test_one_write_of_many_publishes_is_one_commit(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Group commit: "everything that arrives in one pass of the event loop (all
    packets read from all sockets in that pass) is written as one atomic write batch at the end of
    the pass"; "`$SYS/broker/durable/store/commits` counts the writes". 200 QoS 1 PUBLISHes in one
    socket write, each queued for a durable session, cost one commit, and every one gets its
    PUBACK, in order."""
    broker = broker_factory(metrics_interval=0.2)
    device = clients(broker.port, "gc-dev")
    device.subscribe("gc/#", 1)
    device.disconnect()
    watcher = clients(broker.port, "gc-watch", clean_session=True)
    watcher.subscribe(SYS + "store/commits", 0)
    assert watcher.wait_for(lambda ms: len(ms) >= 2), "two metric publications"
    before = latest_number(watcher, SYS + "store/commits")
    count = 200
    sock = raw_connect(broker.port, "gc-pub", clean=True)
    sock.sendall(
        b"".join(
            mqtt_packet(0x32, mqtt_string("gc/t") + (i + 1).to_bytes(2, "big") + payload)
            for i, payload in enumerate(payloads(count))
        )
    )
    acks = read_exactly(sock, 4 * count)
    assert acks == b"".join(b"\x40\x02" + (i + 1).to_bytes(2, "big") for i in range(count))
    seen = len(watcher.messages)
    assert watcher.wait_for(lambda ms: len(ms) >= seen + 2), "a metric publication after the PUBACKs"
    after = latest_number(watcher, SYS + "store/commits")
    assert before is not None and after is not None
    # Assumes one read: one sendall of these ~3.6 KB on loopback arrives in one read of the
    # broker's socket, and all the packets of one read are handled in one pass, so one commit.
    assert after - before == 1, f"{after - before} commits for {count} publishes read in one write"
    sock.close()
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(count)] == payloads(count)


# ------------------------------------------------------------------ operations.md
def test_a_copy_of_a_sigkilled_broker_s_store_is_the_whole_store(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Backing up: "stop the broker (Ctrl-C or SIGTERM; after its process crashed
    or was SIGKILLed the folder holds everything acknowledged too), copy the folder (`cp -a
    data/durable /backups/durable-1`) ... `amqtt-durable inspect /backups/durable-1` lists the
    copy's sessions"; "It records no path of its own, so a copy of the folder is the whole store
    wherever it is put": a broker on the copy serves the session (session present), its queue in
    order, and the retained message (RETAIN=1)."""
    broker = broker_factory()
    device = clients(broker.port, "bk-dev")
    device.subscribe("bk/#", 1)
    device.disconnect()
    publisher = clients(broker.port, "bk-pub", clean_session=True)
    queued = payloads(5, "bk")
    publisher.publish("bk/t", queued)
    publisher.publish("bk/r", [b"kept"], retain=True)
    broker.kill()
    backup = tmp_path / "backups" / "durable-1"
    backup.parent.mkdir()
    copy = ["cp", "-a", broker.store, str(backup)]
    copied = subprocess.run(copy, check=False, capture_output=True, text=True, timeout=WAIT)
    assert copied.returncode == 0, copied.stderr
    listed = run_cli("inspect", str(backup), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["client_id"], r["depth"], r["subscriptions"]) for r in rows] == [("bk-dev", 6, {"bk/#": 1})]
    retained = run_cli("inspect", str(backup), "--retained", "--json")
    assert retained.returncode == 0, retained.stderr
    assert [(r["topic"], r["qos"], r["bytes"]) for r in json.loads(retained.stdout)] == [("bk/r", 1, 4)]
    elsewhere = broker_factory(start=False, name="copy")
    elsewhere.settings["store"] = str(backup)
    elsewhere.start()
    restored = clients(elsewhere.port, "bk-dev")
    assert restored.session_present is True
    assert [m.payload for m in restored.wait_messages(6)] == [*queued, b"kept"]
    assert [m.retain for m in restored.messages] == [False] * 6, "RETAIN=0 on queued messages"
    newcomer = clients(elsewhere.port, "bk-new", clean_session=True)
    newcomer.subscribe("bk/r", 1)
    assert newcomer.wait_for(bool)
    assert [(m.payload, m.retain) for m in newcomer.messages] == [(b"kept", True)]


@pytest.mark.timeout(120)
def test_while_writes_fail_qos0_wills_and_sys_messages_are_not_queued_and_health_is_not_kept(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full, while writes fail: "A QoS 0 one is not queued for
    durable sessions (amqtt's clean-session subscribers still get it) and its connection stays
    open. Wills and `$SYS` messages are not queued for durable sessions either"; "A durable
    session's UNSUBSCRIBE gets its UNSUBACK once the retry has stored the removal", "and its
    SUBSCRIBE gets 0x80 (failure), at once"; the health states read `{"status": "failing",
    "since": ..., "error": "...", "failed_for": null}` then `{"status": "ok", "since": ...,
    "error": null, "failed_for": <seconds>}`, and the log `store write failed: ...` then `store
    writes succeed again after <n> s of failures: serving normally`. guarantees.md: the broker's
    retained `$SYS` topics (`store/health`) "are kept in memory only, so they never outlive the
    state they report": after a restart no health message is retained ("No retained message there
    means the store has not failed since the broker started")."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"), queue_qos0=True)
        port = broker.port
        away = clients(port, "away")
        assert away.subscribe([("q0/#", 1), ("will/#", 1), (HEALTH, 1)]) == [1, 1, 1]
        away.disconnect()
        monitor = clients(port, "monitor", clean_session=True)
        assert monitor.subscribe([("q0/#", 0), ("will/#", 0), (HEALTH, 1)]) == [0, 0, 1]
        live = clients(port, "live")
        assert live.subscribe("u/#", 1) == [1]
        zero = clients(port, "zero-pub", clean_session=True)
        willing = socket.create_connection((HOST, port), timeout=WAIT)
        willing.sendall(connect_packet("willing", clean=True, will_topic=b"will/w"))
        assert read_exactly(willing, 4) == b"\x20\x02\x00\x00"

        filler = failing_writes(clients, port, disk, monitor, "q0/big")
        failing = wait_health(monitor, "failing")
        assert set(failing) == {"status", "since", "error", "failed_for"} and failing["failed_for"] is None
        assert "No space left on device" in str(failing["error"])
        assert wait_for_log(broker, "store write failed")

        zero.publish("q0/t", [b"zero-1"], qos=0)
        assert monitor.wait_for(lambda ms: any(m.payload == b"zero-1" for m in ms)), "clean subscribers get it"
        zero.publish("q0/t", [b"zero-2"], qos=0)
        assert monitor.wait_for(lambda ms: any(m.payload == b"zero-2" for m in ms)), "its connection stays open"
        assert live.subscribe("s/#", 1) == [0x80]
        unsubacked = threading.Event()
        live.paho.on_unsubscribe = lambda *_: unsubacked.set()
        live.paho.unsubscribe("u/#")
        willing.close()  # no DISCONNECT: the will is published
        assert monitor.wait_for(lambda ms: any(m.topic == "will/w" for m in ms)), "clean subscribers get the will"

        assert not unsubacked.wait(0.5), "no UNSUBACK before the removal is stored"
        filler.unlink()
        assert unsubacked.wait(WAIT + 10), "the UNSUBACK once the retry stored the removal"
        recovered = wait_health(monitor, "ok", timeout=WAIT + 10)
        assert set(recovered) == {"status", "since", "error", "failed_for"} and recovered["error"] is None
        assert isinstance(recovered["failed_for"], int | float) and recovered["failed_for"] > 0
        assert isinstance(failing["since"], float | int) and isinstance(recovered["since"], float | int)
        assert abs(recovered["since"] - failing["since"] - recovered["failed_for"]) < 1.0, (failing, recovered)
        (line,) = wait_for_log(broker, "store writes succeed again after ")
        logged = re.search(r"store writes succeed again after ([0-9.]+) s of failures: serving normally$", line)
        assert logged and abs(float(logged[1]) - recovered["failed_for"]) < 0.1, (line, recovered)
        clients(port, "fence-pub", clean_session=True).publish("q0/t", [b"fence"], qos=1)
        assert away.connect() is True
        assert away.wait_for(lambda ms: any(m.payload == b"fence" for m in ms))
        got = [(m.topic, m.payload) for m in away.messages]
        assert ("q0/t", b"zero-1") not in got and ("q0/t", b"zero-2") not in got, got
        assert not [t for t, _ in got if t == "will/w"], got
        assert not [p for t, p in got if t == HEALTH and json.loads(p)["status"] == "failing"], got

        broker.stop()
        broker.start()
        late = clients(port, "late-monitor", clean_session=True)
        late.subscribe(HEALTH, 1)
        assert not late.wait_for(bool, timeout=0.5), "the health state did not outlive the broker"


def test_a_subscribe_read_behind_an_unsubscribe_waiting_for_its_unsuback_is_granted_after_it(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full, while writes fail: a durable session's "SUBSCRIBE
    gets 0x80 (failure), at once, unless it was read behind an UNSUBSCRIBE still waiting for its
    UNSUBACK: a connection's SUBSCRIBEs and UNSUBSCRIBEs are applied one at a time in the order
    they are read, so that SUBSCRIBE waits its turn: it is applied after the UNSUBSCRIBE, once the
    retry has stored the removal, as any SUBSCRIBE is while writes succeed (granted ...), its
    SUBACK after the UNSUBACK"."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"))
        port = broker.port
        live = clients(port, "live")
        assert live.subscribe([("u/#", 1), ("big/#", 1)]) == [1, 1]
        monitor = clients(port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        filler = failing_writes(clients, port, disk, monitor, "big/t")
        answers: list[tuple[str, list[int]]] = []
        answered = threading.Condition()

        def answer(kind: str) -> Callable[..., None]:
            def record(client: object, userdata: object, mid: int, reasons: list[object], props: object) -> None:
                with answered:
                    answers.append((kind, [int(getattr(r, "value", r)) for r in reasons]))
                    answered.notify_all()

            return record

        live.paho.on_unsubscribe = answer("UNSUBACK")
        live.paho.on_subscribe = answer("SUBACK")
        live.paho.unsubscribe("u/#")
        live.paho.subscribe("s/#", 1)
        with answered:
            assert not answered.wait_for(lambda: bool(answers), 0.5), "neither answered before the retry"
        filler.unlink()
        with answered:
            assert answered.wait_for(lambda: len(answers) == 2, WAIT + 10), answers
        assert [kind for kind, _ in answers] == ["UNSUBACK", "SUBACK"], answers
        assert answers[1][1] == [1], "granted once the removal is stored"
        wait_health(monitor, "ok")
        clients(port, "pub", clean_session=True).publish("u/t", [b"unsubscribed"])
        clients(port, "pub2", clean_session=True).publish("s/t", [b"subscribed"])
        assert live.wait_for(lambda ms: any(m.payload == b"subscribed" for m in ms))
        assert [m.topic for m in live.messages if not m.topic.startswith("big/")] == ["s/t"]


def test_a_broker_stopped_while_writes_fail_logs_how_many_writes_it_could_not_store(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full: "A broker stopped during the outage logs how many
    writes it could not store, as a WARNING: `closing with the store still failing (<error>): <n>
    pending write(s) are not stored; every message the broker acknowledged is stored already`"; "A
    crash during the outage loses only what was never acknowledged": what was acknowledged before
    is there after the restart."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"))
        device = clients(broker.port, "dev")
        device.subscribe("o/#", 1)
        device.disconnect()
        monitor = clients(broker.port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        acknowledged = payloads(3, "ack")
        clients(broker.port, "pub", clean_session=True).publish("o/t", acknowledged)
        filler = failing_writes(clients, broker.port, disk, monitor, "o/t")
        broker.stop()
        (line,) = log_lines(broker, "closing with the store still failing (")
        stated = re.search(
            r"\): (\d+) pending write\(s\) are not stored; every message the broker acknowledged is stored already$",
            line,
        )
        assert "WARNING" in line and stated and int(stated[1]) >= 1, line
        filler.unlink()
        broker.start()
        assert device.connect() is True
        assert device.wait_for(lambda ms: [m.payload for m in ms][:3] == acknowledged)


def test_acknowledgements_made_while_writes_fail_are_written_by_the_retry(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full, while writes fail: "connected durable sessions go on
    receiving what is stored; their acknowledgements are kept in memory and written with the
    retry". guarantees.md: "A message stays in LevelDB until its PUBACK": once the retry wrote
    them, a SIGKILL brings none of the acknowledged messages back."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker, reader, monitor, queued = queued_reader(broker_factory, clients, disk, 20, 5)
        filler = failing_writes(clients, broker.port, disk, monitor, "big/t")
        reader.on_message_hook = acknowledging(reader)
        for message in list(reader.messages):
            reader.paho.ack(message.mid, message.qos)
        assert reader.wait_for(lambda ms: len(ms) >= len(queued)), "the rest of the queue, while writes fail"
        assert [m.payload for m in reader.messages] == queued
        filler.unlink()
        wait_health(monitor, "ok", timeout=WAIT + 10)
        reader.disconnect()
        broker.restart(kill=True)
        assert reader.connect() is True
        clients(broker.port, "fence", clean_session=True).publish("r/t", [b"fence"])
        assert reader.wait_for(lambda ms: len(ms) > len(queued))
        assert [m.payload for m in reader.messages[len(queued) :]] == [b"fence"], "nothing acknowledged came again"


def test_without_a_disconnected_byte_limit_max_bytes_applies_from_the_reconnect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: "`max_bytes` and `max_bytes_disconnected` (default 0: no
    limit) add the same two limits in payload bytes ..., with the same expansion and revert (80%
    of both expanded limits)". With `max_bytes_disconnected` 0 a disconnected queue has no byte
    limit, so its backlog may pass `max_bytes`; the revert needs 80% of the expanded limits, and
    there is no byte limit to drain below: at the reconnect (here 10 messages, far below 80% of
    `max_depth_disconnected`) `max_bytes` applies at once, and a live message that does not fit
    is handled by the overflow policy (all of the backlog in flight: dropped, counted, logged)."""
    broker = broker_factory(max_bytes=100, max_bytes_disconnected=0)
    device = clients(broker.port, "nb-dev", manual_ack=True)
    device.subscribe("nb/#", 1)
    device.disconnect()
    backlog = [b"%03d" % i + bytes(97) for i in range(10)]  # 1,000 bytes, ten times max_bytes
    publisher = clients(broker.port, "nb-pub", clean_session=True)
    publisher.publish("nb/t", backlog)
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(10)] == backlog, "no byte limit while disconnected"
    publisher.publish("nb/t", [b"live" + bytes(96)])
    (line,) = wait_for_log(broker, "session nb-dev: queue full at its limit of ")
    assert "limit of 100000 messages / 100 bytes (overflow drop-oldest): dropped 1 message(s)" in line, line
    for message in device.messages:
        device.paho.ack(message.mid, message.qos)
    device.disconnect()
    broker.stop()
    listed = run_cli("inspect", broker.store, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(r["depth"], r["dropped"]) for r in json.loads(listed.stdout)] == [(0, 1)]
    assert [m.payload for m in device.messages] == backlog


def test_inspect_of_a_store_on_a_full_disk_names_the_disk_and_the_store_needs_no_repair(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Troubleshooting: "`cannot read store '...': IO error: ...: No space left on
    device` (`broker not started`, exit code 1, or from `inspect`): opening the store turns its log
    into a table, and its disk is full. Free space on it and start again; the store is not damaged
    and needs no repair"."""
    with small_disk(tmp_path / "disk", 16) as disk:
        store = str(disk / "store")
        broker = broker_factory(store=store)
        queued_while_dropped(clients, broker.port, "fd/#", "fd/t", payloads(3))
        broker.kill()  # what it acknowledged is in the store's log, not yet in a table
        filler = fill(disk)
        refused = run_cli("inspect", store)
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        assert f"cannot read store '{store}': IO error: " in refused.stderr, refused.stderr
        assert "No space left on device" in refused.stderr, refused.stderr
        assert refused.stdout == ""
        filler.unlink()
        listed = run_cli("inspect", store, "--json")
        assert listed.returncode == 0, listed.stderr
        assert [(r["client_id"], r["depth"]) for r in json.loads(listed.stdout)] == [("dev-1", 3)]


def test_sessions_that_expire_while_writes_fail_are_logged_and_announced_once_their_deletion_is_written(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full: "The same holds for a session deleted otherwise
    (expired ...) whose record's erasure is not written yet: a clean CONNECT of its client id gets
    CONNACK 3 until it is (an expiry's WARNING and its `$SYS/broker/durable/expired` event come
    once its whole deletion, record, queue and other keys, is written by the retry, and so do
    those of every other session expiring meanwhile)". guarantees.md, Expiry: the WARNING reads
    `durable session <id> expired after <n> s disconnected: <m> queued message(s) and its
    subscriptions deleted`, the event `{"client_id": "...", "messages_dropped": 12,
    "disconnected_at": 1700000000.0}`; "A client that returns after expiry is a new client
    (session_present=0)". Both sessions disconnect during the outage, so their expiry comes during
    it; `sessions/disconnected` going 1 then 0 tells each one has left the broker's memory."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"), session_expiry=1, metrics_interval=0.2)
        port = broker.port
        keeper = clients(port, "keeper")
        keeper.subscribe("big/#", 1)
        monitor = clients(port, "monitor", clean_session=True)
        away = SYS + "sessions/disconnected"
        assert monitor.subscribe([(HEALTH, 1), (SYS + "expired", 1), (away, 0)]) == [1, 1, 0]
        early, late = clients(port, "early"), clients(port, "late")
        early.subscribe("e/#", 1)
        late.subscribe("l/#", 1)
        filler = failing_writes(clients, port, disk, monitor, "big/t")

        def expired_from_memory(session: Client) -> None:
            """Disconnect ``session`` (its expiry clock starts in memory at once) and wait until
            the metric counted it disconnected, then no more: its expiry has begun."""
            seen = len(monitor.messages)
            session.disconnect()

            def counts() -> list[int]:
                return [int(m.payload) for m in monitor.messages[seen:] if m.topic == away]

            assert monitor.wait_for(lambda _: 1 in counts()), f"{session.client_id} counted disconnected"
            assert monitor.wait_for(lambda _: 0 in counts()[counts().index(1) :]), f"{session.client_id} expired"

        expired_from_memory(early)
        clean = socket.create_connection((HOST, port), timeout=WAIT)
        clean.sendall(connect_packet("early", clean=True))
        assert read_until_closed(clean, WAIT) == b"\x20\x02\x00\x03", "CONNACK 3, then closed"
        clean.close()
        expired_from_memory(late)
        assert not log_lines(broker, "expired after"), "no expiry WARNING before the deletion is written"
        assert not [m for m in monitor.messages if m.topic == SYS + "expired"], "nor its event"
        filler.unlink()
        wait_health(monitor, "ok", timeout=WAIT + 10)
        for client_id in ("early", "late"):
            (line,) = wait_for_log(broker, f"durable session {client_id} expired after ")
            ending = "expired after 1 s disconnected: 0 queued message(s) and its subscriptions deleted"
            assert line.endswith(ending), line
            lines = broker.log().splitlines()
            assert lines.index(line) > lines.index(log_lines(broker, "store writes succeed again")[0])
        assert monitor.wait_for(lambda ms: len([m for m in ms if m.topic == SYS + "expired"]) >= 2), "the events"
        events = [json.loads(m.payload) for m in monitor.messages if m.topic == SYS + "expired"]
        assert all(set(event) == {"client_id", "messages_dropped", "disconnected_at"} for event in events), events
        assert sorted((event["client_id"], event["messages_dropped"]) for event in events) == [
            ("early", 0),
            ("late", 0),
        ], events
        assert clients(port, "early").session_present is False, "a new client after expiry"


def test_a_crash_during_the_outage_sends_again_what_was_acknowledged_during_it_dup_flagged_up_to_the_mark(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, When the disk is full: "A crash during the outage loses only what was never
    acknowledged: the acknowledgements of deliveries made during it were not written, so those
    messages come again on reconnect (with DUP=1 only up to the last stored sent mark)".
    guarantees.md, Recovery buffer: "While writes fail, sending goes on and a crash then costs the
    DUP flag of what was sent meanwhile"; what was acknowledged before the outage does not come
    again, and the rest comes in order."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker, reader, monitor, queued = queued_reader(broker_factory, clients, disk, 12, 3)
        for message in reader.messages[:3]:
            reader.paho.ack(message.mid, message.qos)
        assert reader.wait_for(lambda ms: len(ms) >= 6), "the next window, sent before the outage"
        filler = failing_writes(clients, broker.port, disk, monitor, "big/t")
        reader.on_message_hook = acknowledging(reader)
        for message in reader.messages[3:6]:
            reader.paho.ack(message.mid, message.qos)
        assert reader.wait_for(lambda ms: len(ms) >= len(queued)), "sending goes on while writes fail"
        assert [m.payload for m in reader.messages] == queued
        broker.kill()
        assert reader.wait_disconnected()
        reader.paho.loop_stop()
        filler.unlink()
        broker.start()
        reader.messages.clear()  # the hook still acknowledges each message as it comes
        assert reader.connect() is True
        again = reader.wait_messages(len(queued) - 3)
        assert [m.payload for m in again] == queued[3:], "what was acknowledged during the outage comes again"
        flags = [bool(m.dup) for m in again]
        marked = flags.index(False) if False in flags else len(flags)
        assert marked >= 3 and flags == [True] * marked + [False] * (len(flags) - marked), flags
