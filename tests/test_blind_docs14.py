"""Blind tests of docs/guarantees.md, docs/replication.md and the README's High availability section,
written from those docs alone: what a user relies on, checked as a user would (``amqtt-durable broker -c``
processes, paho clients, the ``inspect --replication`` / ``promote`` tools, SIGKILL, a real etcd)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import HOST, WAIT, Broker, Client, connack_code, free_port, mqtt_packet, mqtt_string, payloads, run_cli

pytestmark = pytest.mark.timeout(60)

SYS_REP = "$SYS/broker/durable/replication/"


# ------------------------------------------------------------------------------------------- helpers
class Nodes:
    """Brokers of one test, each in its own folder, stopped (SIGTERM, then SIGKILL) after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Broker] = []

    def make(self, name: str, **settings: Any) -> Broker:
        folder = self.root / f"{name}{len(self.made)}"
        folder.mkdir()
        broker = Broker(folder, **settings)
        self.made.append(broker)
        return broker

    def primary(self, name: str = "a", *, mode: str = "sync", **settings: Any) -> Broker:
        """A fixed-role primary (CONNACK 0 once ready); its replication address is ``.rep``."""
        rep = free_port()
        replication = {"role": "primary", "name": name, "listen": f"{HOST}:{rep}", "mode": mode}
        replication.update(settings.pop("replication", {}))
        broker = self.make(name, replication=replication, **settings)
        broker.rep = rep  # type: ignore[attr-defined]
        return broker.start()

    def backup(self, name: str, primary_rep: int, **replication: Any) -> Broker:
        """A fixed-role backup following ``primary_rep``; returns once it answers CONNACK 3."""
        rep = free_port()
        settings = {"role": "backup", "name": name, "primary": f"{HOST}:{primary_rep}", "listen": f"{HOST}:{rep}"}
        broker = self.make(name, replication={**settings, **replication})
        broker.rep = rep  # type: ignore[attr-defined]
        broker.spawn()
        assert broker.wait_until(lambda: connack_code(broker.port) == 3, WAIT), broker.log()
        return broker

    def ha(self, name: str, **replication: Any) -> Broker:
        """A broker whose coordinator decides its role (``replication``: coordinator and timings), started
        without waiting: the first of a new cluster answers CONNACK 0, a backup CONNACK 3."""
        rep = free_port()
        replication = {"name": name, "listen": f"{HOST}:{rep}", **replication}
        broker = self.make(name, metrics_interval=0.2, replication=replication)
        broker.rep = rep  # type: ignore[attr-defined]
        broker.spawn()
        return broker

    def failed_start(self, **settings: Any) -> tuple[int, str]:
        """A broker whose configuration is refused: its exit status and output."""
        broker = self.make("bad", **settings)
        broker.spawn()
        assert broker.proc is not None
        try:
            status = broker.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the broker started:\n{broker.log()}")
        return status, broker.log()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    made = Nodes(tmp_path)
    yield made
    for broker in made.made:
        broker.stop()


def rep_of(broker: Broker) -> str:
    return f"{HOST}:{broker.rep}"  # type: ignore[attr-defined]


def in_sync(client: Client, backups: int = 1) -> None:
    """Wait (metrics every 0.2 s) until the primary publishes ``backups`` backup(s) in sync."""
    client.subscribe(SYS_REP + "backups_in_sync", 0)
    want = str(backups).encode()
    assert client.wait_for(lambda ms: any(m.payload == want for m in ms)), [m.payload for m in client.messages]


def wait_log(broker: Broker, pattern: str, timeout: float = WAIT) -> re.Match[str]:
    """The first match of ``pattern`` in the broker's log, waited for (bounded)."""
    found: list[re.Match[str]] = []

    def seen() -> bool:
        match = re.search(pattern, broker.log())
        if match:
            found.append(match)
        return match is not None

    deadline = time.monotonic() + timeout
    while not seen() and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a log file; bounded by the deadline
    assert found, f"{pattern!r} not in the log:\n{broker.log()[-3000:]}"
    return found[0]


def raw(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=WAIT)


def closed_without_reply(sock: socket.socket) -> bytes:
    """Everything the broker sent before closing (b"" for nothing)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def connect_packet(client_id: str, *, clean: bool = True, level: int = 4, name: bytes = b"MQTT") -> bytes:
    flags = 0x02 if clean else 0x00
    body = mqtt_string(name.decode()) + bytes([level, flags, 0, 30]) + mqtt_string(client_id)
    return mqtt_packet(0x10, body)


# ------------------------------------------------------------------------------ the tools' addresses
def test_a_malformed_tool_address_is_a_usage_error_exit_2_and_nobody_there_exit_1() -> None:
    """replication.md, Settings, `listen`: the tools' HOST:PORT: an unbracketed IPv6 address is a usage error,
    exit 2; a well-formed address nobody answers on: exit 1; an answer that is no replication frame at all:
    one line, `replication address HOST:PORT: no answer to STATUS (FrameError: its answer is no replication
    frame: ...)`, exit 1 (it said the backup's `the channel is closed and the backup reconnects ...`)."""
    result = run_cli("inspect", "--replication", "::1:7883")
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    nobody = run_cli("promote", f"{HOST}:{free_port()}")
    assert nobody.returncode == 1, nobody
    assert "Traceback" not in nobody.stderr, nobody.stderr
    with socket.socket() as stranger:  # not a replication address: it answers an HTTP error
        stranger.bind((HOST, 0))
        stranger.listen()
        stranger.settimeout(WAIT)

        def answers_http() -> None:
            with contextlib.suppress(OSError):
                connection, _peer = stranger.accept()
                with connection:
                    connection.settimeout(WAIT)
                    connection.recv(64)  # the tool's question first: a close with it unread would be a reset
                    connection.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answers_http, daemon=True)
        thread.start()
        address = "{}:{}".format(*stranger.getsockname())
        garbage = run_cli("inspect", "--replication", address)
        thread.join(WAIT)
    assert garbage.returncode == 1, garbage
    said = garbage.stderr.strip()
    assert said.startswith(
        f"amqtt-durable: replication address {address}: no answer to STATUS (FrameError: its answer is no "
        "replication frame: a frame does not decode ("
    ), said
    assert said.endswith("); is a broker with replication listening there (its replication.listen)?"), said
    assert "\n" not in said and "the backup reconnects" not in said, said  # a tool's line, not a backup's advice


# --------------------------------------------------------------------------- start-up refusals
def test_allow_from_refusals_exit_2_naming_the_key(nodes: Nodes) -> None:
    """replication.md, allow_from: each strict check is a config error naming replication.allow_from and the
    entry; the broker exits with status 2."""
    for allow_from, says in (
        ([], "replication.allow_from"),
        ([80], "expected an IP address or CIDR network, got 80 (quote it in YAML)"),
    ):
        rep = free_port()
        status, log = nodes.failed_start(
            replication={"role": "primary", "listen": f"{HOST}:{rep}", "allow_from": allow_from}
        )
        assert status == 2, log
        assert "replication.allow_from" in log and says in log, log


def test_replication_settings_refused_at_start(nodes: Nodes) -> None:
    """replication.md, Settings: a coordinator entry with a user or password is refused at start, naming it;
    `primary` is refused when it names the backup's own `listen`; an inline secret has
    at least 16 characters (a ConfigError naming replication.secret)."""
    for replication, names in (
        ({"coordinator": ["http://user:pw@127.0.0.1:2379"], "name": "a"}, "http://user:pw@127.0.0.1:2379"),
        ({"role": "backup", "primary": "LISTEN"}, "replication.primary"),
        ({"role": "primary", "secret": "fifteen-chars!!"}, "replication.secret"),
    ):
        listen = f"{HOST}:{free_port()}"
        settings = {"listen": listen, **{k: (listen if v == "LISTEN" else v) for k, v in replication.items()}}
        status, log = nodes.failed_start(replication=settings)
        assert status != 0, log
        assert names in log, (replication, log)


# ---------------------------------------------------------------------- securing: the tools
def test_tools_with_no_or_a_wrong_secret_exit_1_with_the_reason(nodes: Nodes, tmp_path: Path) -> None:
    """replication.md, On a mismatch: a tool prints the same reason as a backup logs and exits with status 1
    (no secret: `authentication required`; a wrong one: `do not share the replication secret`); with the right
    --secret-file it is answered."""
    secret = "0123456789abcdef0123456789abcdef"
    primary = nodes.primary(replication={"secret": secret})
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("fedcba9876543210fedcba9876543210\n", encoding="utf-8")
    right = tmp_path / "right.secret"
    right.write_text(f"  {secret}\n", encoding="utf-8")
    none = run_cli("inspect", "--replication", rep_of(primary))
    assert none.returncode == 1 and "authentication required" in none.stdout + none.stderr, none
    bad = run_cli("inspect", "--replication", rep_of(primary), "--secret-file", str(wrong))
    assert bad.returncode == 1, bad
    assert "do not share the replication secret" in bad.stdout + bad.stderr, bad
    good = run_cli("inspect", "--replication", rep_of(primary), "--secret-file", str(right))
    assert good.returncode == 0, good
    assert good.stdout.startswith("a: primary, at batch "), good.stdout
    wait_log(primary, r"refused a connection from [^\n]*the peer refused this node")


# --------------------------------------------------------------------------- a fixed-role pair
def test_inspect_and_sys_topics_of_a_sync_pair_and_a_stopped_backup(
    nodes: Nodes, clients: Callable[..., Client]
) -> None:
    """replication.md, Watching it: the primary's `inspect --replication` lines, and its $SYS topics under
    $SYS/broker/durable/replication/ (role, mode, batch, backups, backups_in_sync, refused, backup/<name>/...).
    What each mode guarantees (sync): a clean-session subscriber gets a QoS 1 publish as it is routed, a durable
    session and the publisher's PUBACK only after the in-sync backup confirmed it; a backup lost (here
    SIGSTOPped) is dropped after ack_timeout with a WARNING, the primary goes on without it and catches it up
    when it returns."""
    primary = nodes.primary(metrics_interval=0.2, replication={"ack_timeout": 2})
    backup = nodes.backup("b", primary.rep)  # type: ignore[attr-defined]
    watcher = clients(primary.port, "w", clean_session=True)
    in_sync(watcher)
    sys_topics = clients(primary.port, "w2", clean_session=True)
    sys_topics.subscribe(SYS_REP + "#", 0)
    names = ["role", "mode", "batch", "backups", "refused", "backup/b/state", "backup/b/lag_batches",
             "backup/b/lag_seconds", "backup/b/snapshot_rows"]  # fmt: skip

    def latest() -> dict[str, bytes]:
        return {m.topic[len(SYS_REP) :]: m.payload for m in sys_topics.messages}

    assert sys_topics.wait_for(lambda ms: all(n in latest() for n in names)), latest()
    values = latest()
    assert values["role"] == b"primary" and values["mode"] == b"sync", values
    assert values["backups"] == b"1" and values["refused"] == b"0", values
    assert values["backup/b/state"] == b"in_sync", values
    assert values["backup/b/lag_batches"] == b"0" and values["backup/b/lag_seconds"] == b"0.0", values
    assert int(values["batch"]) >= 1, values
    result = run_cli("inspect", "--replication", rep_of(primary))
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"a: primary, at batch \d+, sync replication", lines[0]), lines
    row = r"  backup b \(127\.0\.0\.1:\d+\): in_sync, acked (\d+), lag 0 batches / 0\.0 s"
    assert any(re.fullmatch(row, line) for line in lines), lines
    status = json.loads(run_cli("inspect", "--replication", rep_of(primary), "--json").stdout)
    assert isinstance(status, dict) and status.get("role") == "primary", status
    clean = clients(primary.port, "clean", clean_session=True)
    clean.subscribe("t", 1)
    durable = clients(primary.port, "durable")
    durable.subscribe("t", 1)
    publisher = clients(primary.port, "pub", clean_session=True)
    with backup.paused():
        info = publisher.paho.publish("t", b"x", qos=1)
        assert clean.wait_for(lambda ms: len(ms) == 1)
        assert durable.messages == [] and not info.is_published()
        lagging = re.compile(rb"[0-9]+\.[0-9]{1,3}")  # `lag_seconds`: to the millisecond, above 0 while it lags
        assert sys_topics.wait_for(
            lambda ms: any(m.topic.endswith("/lag_seconds") and m.payload != b"0.0" for m in ms)
        ), latest()
        lag = [m.payload for m in sys_topics.messages if m.topic.endswith("/lag_seconds") and m.payload != b"0.0"]
        assert lagging.fullmatch(lag[0]), lag
        assert durable.wait_for(lambda ms: len(ms) == 1)
        info.wait_for_publish(WAIT)
        assert info.is_published()
        wait_log(primary, r"WARNING[^\n]*backup b \(127\.0\.0\.1:\d+\)[^\n]*")
        assert watcher.wait_for(lambda ms: ms[-1].payload == b"0")  # the backup no longer counted
        watcher.messages.clear()
    assert watcher.wait_for(lambda ms: any(m.payload == b"1" for m in ms)), "not caught up again"


def test_failover_by_promote_plain_client_gets_its_queue_with_dup(nodes: Nodes, clients: Callable[..., Client]) -> None:
    """replication.md, fixed roles + Clients: the primary SIGKILLed, `promote` on the backup (exit 0); a plain
    durable session then gets session_present=1, its whole queue and DUP on what was in flight (sync mode:
    nothing acknowledged is lost); a retained message survives; the promoted node is the primary
    (`promote` again: exit 1, `it is the primary already`)."""
    primary = nodes.primary(metrics_interval=0.2)
    backup = nodes.backup("b", primary.rep)  # type: ignore[attr-defined]
    watcher = clients(primary.port, "w", clean_session=True)
    device = clients(primary.port, "dev", manual_ack=True)
    assert device.subscribe("t/#", 1) == [1]
    device.disconnect()
    in_sync(watcher)  # sync mode: from now on each PUBACK follows the backup's copy
    publisher = clients(primary.port, "pub", clean_session=True)
    publisher.publish("t/r", [b"kept"], qos=1, retain=True)
    publisher.publish("t/x", payloads(6), qos=1)
    device.connect()
    assert device.wait_for(lambda ms: len(ms) >= 7)  # the retained one and 6, none acknowledged
    assert [m.dup for m in device.messages] == [False] * 7
    assert "WARNING" not in backup.log(), backup.log()  # its CONNACK 3 answers: DEBUG, amqtt's own too
    primary.kill()
    watcher.paho.loop_stop()
    promoted = run_cli("promote", rep_of(backup))
    assert promoted.returncode == 0, promoted
    assert backup.wait_until(lambda: connack_code(backup.port) == 0, WAIT), backup.log()
    again = clients(backup.port, "dev")
    assert again.session_present is True
    got = again.wait_messages(7)
    assert [m.payload for m in got] == [b"kept", *payloads(6)], [m.payload for m in got]
    assert all(m.dup for m in got), [(m.payload, m.dup) for m in got]
    assert [m.mid for m in got] == [m.mid for m in device.messages]  # ids from the queue's sequence numbers
    newcomer = clients(backup.port, "new", clean_session=True)
    newcomer.subscribe("t/r", 1)
    assert newcomer.wait_for(lambda ms: len(ms) == 1)
    assert newcomer.messages[0].payload == b"kept" and newcomer.messages[0].retain
    second = run_cli("promote", rep_of(backup))
    assert second.returncode == 1 and "it is the primary already" in second.stdout + second.stderr, second


def test_a_backup_pointed_at_a_backup_is_told_so(nodes: Nodes) -> None:
    """replication.md, A backup pointed at a backup: the ERROR text, the pointed backup's WARNING, and
    `inspect --replication` on it: `disconnected, not caught up` and the reason on a line of its own."""
    primary = nodes.primary()
    backup = nodes.backup("b", primary.rep)  # type: ignore[attr-defined]
    lost = nodes.backup("c", backup.rep)  # type: ignore[attr-defined]
    refusal = (
        f"not the primary: backup b (follows {rep_of(primary)}); replication.primary must name the primary's address"
    )
    line = (
        f"replication: backup c: channel to {rep_of(backup)} refused (retried every 0.5 s, this line at most once "
        f"a minute): {refusal}"
    )
    wait_log(lost, re.escape(line))
    status = run_cli("inspect", "--replication", rep_of(lost))
    assert status.returncode == 0, status
    assert "disconnected, not caught up" in status.stdout, status.stdout
    assert any(refusal in text for text in status.stdout.splitlines()), status.stdout
    shown = json.loads(run_cli("inspect", "--replication", rep_of(lost), "--json").stdout)
    assert refusal in json.dumps(shown.get("refused_by_primary")), shown


def test_a_second_backup_name_and_one_past_max_backups_are_refused(
    nodes: Nodes, clients: Callable[..., Client]
) -> None:
    """replication.md, One name, one backup: a second backup under a connected name is refused with the quoted
    texts on both sides. How many backups: one HELLO past max_backups gets `too many backups: max_backups is N
    (backup NAME refused; it retries)` (a WARNING on both sides), counted in `refused`; once a served backup's
    connection ends, it is accepted at its next try (INFO `accepted by the primary: a place among its backups
    is free`)."""
    primary = nodes.primary(metrics_interval=0.2, replication={"max_backups": 1})
    first = nodes.backup("b", primary.rep)  # type: ignore[attr-defined]
    watcher = clients(primary.port, "w", clean_session=True)
    in_sync(watcher)
    copy = nodes.backup("b", primary.rep)  # type: ignore[attr-defined]  # its name is refused first
    wait_log(
        primary,
        r"refused backup name b from 127\.0\.0\.1:\d+: the name b is in use by the backup connected from "
        r"127\.0\.0\.1:\d+, another broker process",
    )
    wait_log(copy, rf"channel to {re.escape(rep_of(primary))} refused for its name")
    assert "give each backup its own replication.name" in copy.log(), copy.log()
    copy.stop()
    extra = nodes.backup("c", primary.rep)  # type: ignore[attr-defined]
    text = "too many backups: max_backups is 1 (backup c refused; it retries)"
    wait_log(
        primary,
        rf"refused a connection from 127\.0\.0\.1:\d+: {re.escape(text)}; refusals of this name for the cap are "
        r"logged at most once a minute",
    )
    wait_log(
        extra,
        rf"replication: backup c: channel to {re.escape(rep_of(primary))} refused \(retried every 5 s, this line "
        rf"at most once a minute\): refused by the primary: {re.escape(text)}",
    )
    status = run_cli("inspect", "--replication", rep_of(primary))
    assert re.search(r"connections refused on its replication address since start: [1-9]", status.stdout), status
    watcher.subscribe(SYS_REP + "refused", 0)
    assert watcher.wait_for(lambda ms: any(m.topic.endswith("/refused") and m.payload not in (b"0", b"") for m in ms))
    first.kill()
    wait_log(extra, re.escape("accepted by the primary: a place among its backups is free"), timeout=2 * WAIT)


def test_a_primary_that_closes_the_channel_at_the_hello_is_logged_once_a_minute(nodes: Nodes) -> None:
    """replication.md, A backup pointed at a backup: a node that closes the channel before answering the HELLO
    (a primary or backup of an earlier version) gets the quoted WARNING the first time, then at most once a
    minute, while the backup retries every 0.5 s."""
    accepted = threading.Semaphore(0)
    with socket.socket() as server:
        server.bind((HOST, 0))
        server.listen()
        server.settimeout(WAIT)
        port = server.getsockname()[1]

        def closes_each_connection() -> None:
            for _ in range(3):  # the first try and two retries
                with contextlib.suppress(OSError):
                    connection, _peer = server.accept()
                    with connection:
                        connection.settimeout(WAIT)
                        connection.recv(4096)  # the HELLO
                    accepted.release()

        thread = threading.Thread(target=closes_each_connection, daemon=True)
        thread.start()
        backup = nodes.backup("b", port)
        for _ in range(3):
            assert accepted.acquire(timeout=WAIT), "the backup did not retry"
        thread.join(WAIT)
    line = (
        f"replication: backup b: the primary at {HOST}:{port} closed the channel: it closed the "
        "channel before answering the HELLO (is it the primary of this version? a backup of an earlier version "
        "closes it so, and so does a primary of an earlier version) (retried every 0.5 s, this line at most once a "
        "minute)"
    )
    wait_log(backup, re.escape(line))
    assert backup.log().count("closed the channel before answering the HELLO") == 1, backup.log()


# ------------------------------------------------------------------------------------ with etcd
@pytest.mark.timeout(90)
def test_etcd_pair_promote_refused_then_failover_by_the_lease(
    nodes: Nodes, etcd: Any, clients: Callable[..., Client]
) -> None:
    """replication.md with a coordinator: `promote` is refused (exit 1) while a primary holds the lease
    (`its coordinator decides who is primary: ...`); inspect lists the members (`b: backup, at batch N, store
    S, may take over`); the primary SIGKILLed, the backup takes the lease by itself and a durable session finds
    session_present=1 and its queue there."""
    ha = {"coordinator": [etcd.url], "lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5, "mode": "sync"}

    a = nodes.ha("a", **ha)
    a.wait_ready()
    b = nodes.ha("b", **ha)
    assert b.wait_until(lambda: connack_code(b.port) == 3, WAIT), b.log()
    in_sync(clients(a.port, "w", clean_session=True))
    device = clients(a.port, "dev")
    device.subscribe("q", 1)
    device.disconnect()

    def members() -> str:
        return run_cli("inspect", "--replication", rep_of(a)).stdout

    listing = members()
    deadline = time.monotonic() + WAIT
    while not re.search(r"\n    b: backup, at batch \d+, store \S+, may take over", listing):
        assert time.monotonic() < deadline, listing
        listing = members()  # each call takes its own time
    assert "  members in the coordinator (as of this node's last HA cycle):" in listing, listing
    refused = run_cli("promote", rep_of(b))
    assert refused.returncode == 1, refused
    assert "its coordinator decides who is primary" in refused.stdout + refused.stderr, refused
    publisher = clients(a.port, "pub", clean_session=True)
    publisher.publish("q", payloads(5), qos=1)
    publisher.paho.loop_stop()
    a.kill()
    assert b.wait_until(lambda: connack_code(b.port) == 0, 4 * WAIT), b.log()
    again = clients(b.port, "dev")
    assert again.session_present is True
    assert [m.payload for m in again.wait_messages(5)] == payloads(5)


@pytest.mark.timeout(90)
def test_etcd_node_that_may_lack_publishes_waits_until_the_operator_promotes_it(nodes: Nodes, etcd: Any) -> None:
    """replication.md, After a full stop of the group: a node that is neither caught up nor the last primary
    (nor in its synchronous set) waits with the quoted WARNING, `inspect --replication` names whom it waits
    for, and `promote` prints the operator's decision (exit 0) and makes it the primary."""
    ha = {"coordinator": [etcd.url], "lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5}

    a = nodes.ha("a", **ha)
    a.wait_ready()
    a.kill()
    c = nodes.ha("c", **ha)
    wait_log(
        c,
        re.escape(
            "replication HA c: no primary, but this node is not caught up with the last one, nor the last primary "
            "or in its synchronous set (a): it may lack acknowledged publishes; not taking the lease until one of "
            "them is primary again (or the operator promotes a node: "
        ),
        timeout=2 * WAIT,
    )
    status = run_cli("inspect", "--replication", rep_of(c))
    assert status.returncode == 0, status
    assert "\n  waiting for: a\n" in status.stdout, status.stdout
    assert status.stdout.startswith("c: backup, at batch "), status.stdout
    assert connack_code(c.port) == 3
    promoted = run_cli("promote", rep_of(c))
    assert promoted.returncode == 0, promoted
    said = (
        rf"{re.escape(rep_of(c))}: the operator's decision: no primary holds the lease; this node, at batch \d+, "
        r"not known to be caught up, takes it at its next HA cycle unless another node takes it first; it serves "
        r"clients as the primary once its store is loaded"
    )
    assert re.fullmatch(said, promoted.stdout.strip()), promoted.stdout
    assert c.wait_until(lambda: connack_code(c.port) == 0, WAIT), c.log()


@pytest.mark.timeout(90)
def test_etcd_clean_stop_of_an_async_primary_releases_the_lease_and_loses_nothing(
    nodes: Nodes, etcd: Any, clients: Callable[..., Client]
) -> None:
    """replication.md, Clean stop of a primary: the broker waits until the in-sync backups have every batch,
    then the lease is released (so a backup takes over at once, not after lease_ttl); in async mode a clean stop
    therefore loses nothing acknowledged. Watching it: `inspect` says `async replication`."""
    ttl = 10
    ha = {"coordinator": [etcd.url], "lease_ttl": ttl, "loop_wait": 0.3, "demote_margin": 1, "mode": "async"}

    a = nodes.ha("a", **ha)
    a.wait_ready()
    b = nodes.ha("b", **ha)
    assert b.wait_until(lambda: connack_code(b.port) == 3, WAIT), b.log()
    in_sync(clients(a.port, "w", clean_session=True))
    status = run_cli("inspect", "--replication", rep_of(a))
    assert re.match(r"a: primary, at batch \d+, async replication\n", status.stdout), status.stdout
    device = clients(a.port, "dev")
    device.subscribe("q", 1)
    device.disconnect()
    clients(a.port, "pub", clean_session=True).publish("q", payloads(40), qos=1)
    a.stop()
    stopped = time.monotonic()
    assert b.wait_until(lambda: connack_code(b.port) == 0, ttl - 1), "the lease was not released"
    assert time.monotonic() - stopped < ttl - 1
    again = clients(b.port, "dev")
    assert again.session_present is True
    assert [m.payload for m in again.wait_messages(40)] == payloads(40)


# ------------------------------------------------------------------------------------ guarantees
def test_session_expiry_half_a_second_warning_and_sys_message(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: the WARNING `durable session <id> expired after <n> s disconnected: <m> queued
    message(s) and its subscriptions deleted` (`0.5` written as such), the QoS 1 message on
    $SYS/broker/durable/expired, and a return after it is a new client (session_present=0)."""
    broker = broker_factory(session_expiry=0.5)
    watcher = clients(broker.port, "watch")
    watcher.subscribe("$SYS/broker/durable/expired", 1)
    device = clients(broker.port, "dev-x", manual_ack=True)
    device.subscribe("e", 1)
    clients(broker.port, "pub", clean_session=True).publish("e", payloads(2), qos=1)
    assert len(device.wait_messages(2)) == 2  # sent, never acknowledged: still queued
    device.disconnect()
    assert watcher.wait_for(lambda ms: len(ms) >= 1)
    message = watcher.messages[0]
    assert message.qos == 1
    record = json.loads(message.payload)
    assert record["client_id"] == "dev-x" and record["messages_dropped"] == 2, record
    assert isinstance(record["disconnected_at"], float), record
    line = "durable session dev-x expired after 0.5 s disconnected: 2 queued message(s) and its subscriptions deleted"
    assert line in broker.log(), broker.log()
    again = clients(broker.port, "dev-x")
    assert again.session_present is False


def test_first_packet_not_connect_warnings_name_the_peer(broker: Broker) -> None:
    """guarantees.md: a first packet of another type, or a CONNECT with fixed header flags not 0000, is refused
    unanswered, the WARNING naming the peer's address and the reason."""
    with raw(broker.port) as sock:
        port = sock.getsockname()[1]
        sock.sendall(b"\xf0\x00")
        assert closed_without_reply(sock) == b""
    wait_log(
        broker,
        re.escape(
            f"closing a connection from 127.0.0.1:{port} before its CONNECT was read: its first packet is of type "
            "15, not CONNECT (MQTT-3.1.0-1)"
        ),
    )
    with raw(broker.port) as sock:
        port = sock.getsockname()[1]
        packet = connect_packet("flags")
        sock.sendall(bytes([0x11]) + packet[1:])
        assert closed_without_reply(sock) == b""
    wait_log(
        broker,
        re.escape(
            f"closing a connection from 127.0.0.1:{port} before its CONNECT was read: packet type 1 with fixed "
            "header flags 0b0001, not 0b0000 (MQTT-2.2.2-2)"
        ),
    )


def test_second_connect_closes_with_its_warning_and_publishes_the_will(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md: a second CONNECT on a connection closes it with the WARNING `closing the connection of
    <client id>: a second CONNECT on the connection (MQTT-3.1.0-2)`; the will is published."""
    watcher = clients(broker.port, "w", clean_session=True)
    watcher.subscribe("will/t", 1)
    will = mqtt_string("will/t") + mqtt_string("gone")
    body = mqtt_string("MQTT") + bytes([4, 0x02 | 0x04 | 0x08, 0, 30]) + mqtt_string("twice") + will
    with raw(broker.port) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        assert sock.recv(4) == b"\x20\x02\x00\x00"
        sock.sendall(connect_packet("twice"))
        assert closed_without_reply(sock) == b""
    wait_log(broker, re.escape("closing the connection of twice: a second CONNECT on the connection (MQTT-3.1.0-2)"))
    assert watcher.wait_for(lambda ms: [m.payload for m in ms] == [b"gone"])


def test_protocol_level_5_gets_connack_1_and_mqisdp_no_connack(broker: Broker) -> None:
    """guarantees.md, MQTT 3.1.1 only: protocol level 5 gets CONNACK 1; the protocol name MQIsdp is closed
    without a CONNACK; a durable CONNECT with an empty client id gets CONNACK 2. The message path: a CONNECT
    whose will topic starts with `$` is closed without a CONNACK, its WARNING naming the will topic's problem
    (it said `refused: will the topic starts with $ ...`)."""
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("five", level=5))
        assert sock.recv(4) == b"\x20\x02\x00\x01"
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("old", level=3, name=b"MQIsdp"))
        assert closed_without_reply(sock) == b""
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("", clean=False))
        assert closed_without_reply(sock) == b"\x20\x02\x00\x02"
    will = mqtt_string("$SYS/fake") + mqtt_string("m")
    with raw(broker.port) as sock:  # a will topic starting with $: closed without a CONNACK
        sock.sendall(mqtt_packet(0x10, mqtt_string("MQTT") + bytes([4, 0x06, 0, 30]) + mqtt_string("willd") + will))
        assert closed_without_reply(sock) == b""
    wait_log(
        broker,
        re.escape(
            "CONNECT of 'willd' refused: its will topic: the topic starts with $, which is reserved for the broker "
            "(MQTT-4.7.2-1)"
        ),
    )
    with raw(broker.port) as sock:  # will QoS 3
        sock.sendall(mqtt_packet(0x10, mqtt_string("MQTT") + bytes([4, 0x1E, 0, 30]) + mqtt_string("wq3") + will))
        assert closed_without_reply(sock) == b""
    wait_log(broker, re.escape("CONNECT of 'wq3' refused: will QoS 3 (MQTT-3.1.2-14)"))
    with raw(broker.port) as sock:  # will QoS 1 and will retain without the will flag
        sock.sendall(mqtt_packet(0x10, mqtt_string("MQTT") + bytes([4, 0x2A, 0, 30]) + mqtt_string("wnf")))
        assert closed_without_reply(sock) == b""
    wait_log(
        broker,
        re.escape(
            "CONNECT of 'wnf' refused: will QoS or retain flag set without a will flag (MQTT-3.1.2-13, MQTT-3.1.2-15)"
        ),
    )


def test_retained_on_overlapping_filters_comes_once_per_filter_at_each_qos(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md: a SUBSCRIBE of `a/#` at QoS 0 and `a/b` at QoS 1 gets a retained `a/b` stored at QoS 1
    twice, at QoS 0 and 1, RETAIN=1, durable and clean sessions alike."""
    clients(broker.port, "pub", clean_session=True).publish("a/b", [b"r"], qos=1, retain=True)
    for clean in (True, False):
        sub = clients(broker.port, f"sub-{clean}", clean_session=clean)
        assert sub.subscribe([("a/#", 0), ("a/b", 1)]) == [0, 1]
        assert sub.wait_for(lambda ms: len(ms) >= 2)
        assert sorted(m.qos for m in sub.messages) == [0, 1], clean
        assert all(m.retain and m.payload == b"r" for m in sub.messages), clean


def test_pubrel_of_an_unknown_packet_id_gets_pubcomp(broker: Broker) -> None:
    """guarantees.md: a PUBREL of a packet id nothing awaits gets its PUBCOMP (MQTT-4.3.3) and keeps the
    connection."""
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("rel"))
        assert sock.recv(4) == b"\x20\x02\x00\x00"
        sock.sendall(b"\x62\x02\x12\x34")
        assert sock.recv(4) == b"\x70\x02\x12\x34"
        sock.sendall(b"\xc0\x00")
        assert sock.recv(2) == b"\xd0\x00"


def test_qos2_resend_after_sigkill_is_not_routed_again(broker: Broker, clients: Callable[..., Client]) -> None:
    """guarantees.md, Exactly-once from QoS 2 publishers, also across a crash: a durable publisher's QoS 2
    PUBLISH got PUBREC; the broker SIGKILLed and restarted, the same packet id sent again (DUP) gets PUBREC
    and is not routed again; its PUBREL gets PUBCOMP; the durable subscriber has it once."""
    sub = clients(broker.port, "q2-sub")
    sub.subscribe("q2", 2)
    sub.disconnect()
    publish = mqtt_packet(0x34, mqtt_string("q2") + b"\x00\x07" + b"once")
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("q2-pub", clean=False))
        assert sock.recv(4)[:2] == b"\x20\x02"
        sock.sendall(publish)
        assert sock.recv(4) == b"\x50\x02\x00\x07"
    broker.restart()
    with raw(broker.port) as sock:
        sock.sendall(connect_packet("q2-pub", clean=False))
        assert sock.recv(4) == b"\x20\x02\x01\x00"
        sock.sendall(bytes([0x3C]) + publish[1:])
        reply = sock.recv(4)
        assert reply == b"\x50\x02\x00\x07", reply
        sock.sendall(b"\x62\x02\x00\x07")
        assert sock.recv(4) == b"\x70\x02\x00\x07"
    again = clients(broker.port, "q2-sub")
    assert again.session_present is True
    got = again.wait_messages(1)
    assert [m.payload for m in got] == [b"once"]
    assert not again.wait_for(lambda ms: len(ms) > 1, timeout=0.5)
