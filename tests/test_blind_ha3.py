"""A third blind pass over docs/replication.md and README.md's "High availability", from the docs' words
only: each taking of the lease as a term in etcd's `leader`, `primary` and `sync` keys (a group whose
cluster and names are not ASCII), a backup caught up past a one-batch retained log in 1 KiB snapshot
chunks, a stranger posing as a backup on the replication address, a backup whose TLS certificate is
refused, and a lagging backup's lag. Real broker processes on 127.0.0.1 ports, a real etcd, real paho
clients, real SIGKILL/SIGSTOP and the real ``amqtt-durable`` command."""

from __future__ import annotations

import base64
import json
import re
import socket
import struct
from collections.abc import Callable
from typing import Any

import pytest
from replication_helpers import cluster_pki
from test_docs_promises_ha2 import _b64, _etcd
from test_ha_brokers import (
    BACKUP,
    HA_TIMING,
    SERVING,
    address,
    assert_queue_served,
    node,
    queue_durable_messages,
    start,
    static_pair,
    wait_status,
)
from test_hostile_wire import wait_until

from amqtt_durable.replication.framing import Frame, encode_frame
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli

pytestmark = pytest.mark.timeout(90)

SYS = "$SYS/broker/durable/replication/"


def _latest(monitor: Client, key: str) -> bytes | None:
    """The last payload ``monitor`` got on ``$SYS/broker/durable/replication/<key>``, None before any."""
    return next((m.payload for m in reversed(monitor.messages) if m.topic == SYS + key), None)


GROUP, A, B = "grüppe Ω", "knoten-ä", "knoten-ö"  # a cluster and names that are not ASCII
PREFIX = f"/amqtt-durable/{GROUP}/"


def _key(etcd: Any, name: str) -> dict[str, Any] | None:
    """etcd's record of ``PREFIX + name`` (value decoded as JSON, revisions as ints), None when absent."""
    kvs = _etcd(etcd, "/v3/kv/range", {"key": _b64(PREFIX + name)}).get("kvs") or []
    if not kvs:
        return None
    (kv,) = kvs
    return {
        "value": json.loads(base64.b64decode(kv["value"])),
        "create_revision": int(kv["create_revision"]),
        "mod_revision": int(kv["mod_revision"]),
    }


@pytest.mark.slow
def test_each_taking_of_the_lease_is_a_later_term_named_by_the_leader_primary_and_sync_keys(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    """Coordination, the keys: `leader` "JSON name + address; its create_revision is the holder's term";
    `primary` "JSON name + address of the last node that took the lease, written in the same transaction as
    `leader` (so its mod_revision is that `leader` key's create_revision: the term)"; `sync` "JSON `leader`
    (its writer), `term` (the writer's term) and `members`: the synchronous set". "each taking
    of the lease is a term: etcd's revision of that write, larger for a later one". Settings: `cluster` "not
    empty, without `/`; its etcd keys live under `/amqtt-durable/<cluster>/`"; `name` "without `/`, `+`, `#` or
    a control character, at most 1024 bytes of UTF-8 (a level of its `$SYS` topics and etcd key)": a group
    `grüppe Ω` of `knoten-ä` and `knoten-ö`, the backup `backup/knoten-ö/state` on the primary's `$SYS` topics.
    After the primary's SIGKILL the backup takes the lease in a later term; the old primary, started again,
    follows it and joins its synchronous set; nothing acknowledged is lost."""
    ha = {"cluster": GROUP}
    first = start(
        node(broker_factory, A, {"metrics_interval": 0.2}, coordinator=[etcd.url], **HA_TIMING, **ha), SERVING
    )
    second = start(node(broker_factory, B, coordinator=[etcd.url], **HA_TIMING, **ha), BACKUP)
    wait_status(second, lambda s: s["caught_up"])
    monitor = clients(first.port, "monitor", clean_session=True)
    monitor.subscribe(SYS + "backup/+/state", 0)
    assert monitor.wait_for(lambda got: any(m.payload == b"in_sync" for m in got)), monitor.messages
    assert {m.topic for m in monitor.messages} == {SYS + f"backup/{B}/state"}
    queue_durable_messages(first, clients, 20)

    def settled(leader: str, backup: str) -> bool:
        sync = _key(etcd, "sync")
        return sync is not None and sync["value"].get("leader") == leader and sync["value"].get("members") == [backup]

    assert wait_until(lambda: settled(A, B), WAIT), _key(etcd, "sync")
    assert _key(etcd, f"members/{A}") is not None and _key(etcd, f"members/{B}") is not None
    leader, primary, sync = (_key(etcd, key) for key in ("leader", "primary", "sync"))
    assert leader is not None and primary is not None and sync is not None
    term = leader["create_revision"]
    assert leader["value"] == primary["value"] == {"name": A, "address": address(first)}
    assert primary["mod_revision"] == term
    assert sync["value"] == {"leader": A, "term": term, "members": [B]}
    first.kill()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, 2 + WAIT), second.log()
    start(first, BACKUP)  # the old primary comes back as a backup
    assert wait_until(lambda: settled(B, A), WAIT), _key(etcd, "sync")
    leader, primary, sync = (_key(etcd, key) for key in ("leader", "primary", "sync"))
    assert leader is not None and primary is not None and sync is not None
    assert leader["create_revision"] > term, "a later taking of the lease is a larger term"
    assert leader["value"] == primary["value"] == {"name": B, "address": address(second)}
    assert primary["mod_revision"] == leader["create_revision"]
    assert sync["value"] == {"leader": B, "term": leader["create_revision"], "members": [A]}
    assert_queue_served(second, clients, 20)


def test_a_backup_dropped_past_a_one_batch_retained_log_is_caught_up_with_1_kib_snapshot_chunks(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """What each mode guarantees, "Backup lost": "the primary goes on after `ack_timeout` ... without it,
    and catches it up when it returns" ("from the primary's retained log of recent batches ... when its
    position is still there, otherwise from a snapshot of the store streamed in chunks"), with settings at
    their floor: `retained_batches` 1, `retained_bytes` 1024 ("the newest batch is kept whatever its size"),
    `snapshot_chunk_bytes` 1024 ("a chunk ends with the row that reaches this size"): payloads of 3 KiB.
    Then the primary is SIGKILLed and the backup promoted: nothing acknowledged is lost."""
    tight = {"retained_batches": 1, "retained_bytes": 1024, "snapshot_chunk_bytes": 1024, "ack_timeout": 1.0}
    primary, backup = static_pair(broker_factory, {"metrics_interval": 0.2}, **tight)
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe(SYS + "#", 0)

    def latest(key: str) -> bytes | None:
        return _latest(monitor, key)

    subscriber = clients(primary.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    publisher = clients(primary.port, "publisher", clean_session=True)
    big = [b"%04d" % i + b"x" * 3072 for i in range(30)]
    publisher.publish("t/a", big[:10])
    with backup.paused():
        publisher.publish("t/a", big[10:11])  # acknowledged once the silent backup is dropped
        assert monitor.wait_for(lambda _: latest("backups_in_sync") == b"0"), monitor.messages[-8:]
        for payload in big[11:20]:  # a batch each: the dropped backup's position leaves the one-batch log
            publisher.publish("t/a", [payload])
    publisher.publish("t/a", big[20:])
    assert monitor.wait_for(lambda _: latest("backup/b/state") == b"in_sync" and latest("backups_in_sync") == b"1")
    wait_status(backup, lambda s: s["caught_up"])
    publisher.disconnect()
    log = primary.log()
    behind = log.find("too far behind: the retained log starts at")
    assert behind >= 0 and log.find("snapshot at batch", behind) > behind, log

    primary.kill()
    assert run_cli("promote", address(backup)).returncode == 0
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    device = clients(backup.port, "device")
    assert device.session_present is True
    assert [m.payload for m in device.wait_messages(30)] == big


def _hello(name: str) -> bytes:
    """A HELLO as framing.py writes it down: version 1, store id 0, position (0, 0), a name, no process id."""
    return encode_frame(Frame.HELLO, struct.pack(">HQQI", 1, 0, 0, 0) + name.encode())


def test_a_stranger_posing_as_a_backup_never_counts_for_acknowledgements_and_the_pair_loses_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Securing the channel: without settings "anyone who reaches a node's `listen` address can connect as a
    fake backup and receive a snapshot"; such a backup "Until it is in sync ... does not count for sync
    acknowledgements" (it is sent IN_SYNC "after a snapshot only once the backup has acknowledged the
    snapshot's batch"). A stranger sends a HELLO and then never reads nor acknowledges: it shows on the
    primary's `$SYS` topics as `backup/<name>/state` `snapshot` or `catching_up`, never `in_sync`, while
    the real backup stays in sync and every publish is acknowledged (`ack_timeout` 60 s: a PUBACK that
    waited for the stranger would not come within the test's bound); its garbage then closes its
    connection ("one that fails its checksum closes that connection at once ... and the node goes on"). A
    HELLO under a name no backup can have (Settings, `name`: "without `/`, `+`, `#` ... (a level of its `$SYS`
    topics ...)") is closed at once too ("The primary refuses a HELLO ... whose name holds `/`, `+` or `#`")
    and never shows in the `$SYS` topics: it is refused as the handshake refuses one (a WARNING `refused a
    connection from ADDRESS:PORT: a HELLO does not decode (...)`, counted in `refused`).
    The primary is SIGKILLed and the real backup promoted: every acknowledged publish is there."""
    primary, backup = static_pair(broker_factory, {"metrics_interval": 0.2}, ack_timeout=60.0)
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe(SYS + "#", 0)

    def latest(key: str) -> bytes | None:
        return _latest(monitor, key)

    queue_durable_messages(primary, clients, 20)
    host, port = address(primary).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stranger.sendall(_hello("intruder"))
        peer = "{}:{}".format(*stranger.getsockname()[:2])
        assert monitor.wait_for(lambda _: latest("backups") == b"2"), monitor.messages[-8:]
        publisher = clients(primary.port, "publisher2", clean_session=True)
        publisher.publish("t/a", payloads(20, "late"))  # sync mode: acknowledged without the stranger
        intruder = (b"snapshot", b"catching_up")
        assert monitor.wait_for(lambda _: latest("backup/intruder/state") in intruder), monitor.messages[-8:]
        assert latest("backups_in_sync") == b"1" and latest("backup/b/state") == b"in_sync"
        states = {m.payload for m in monitor.messages if m.topic == SYS + "backup/intruder/state"}
        assert b"in_sync" not in states, states
        with socket.create_connection((host, int(port)), timeout=WAIT) as wildcard:
            wildcard.sendall(_hello("evil/+/#"))  # never a replication.name: not a level of the $SYS topics
            refused = "{}:{}: a HELLO does not decode (".format(*wildcard.getsockname()[:2])
            while wildcard.recv(4096):  # the node closes it; bounded by the socket's timeout
                pass
        stranger.sendall(b"\x07garbage-that-fails-its-checksum")
        assert monitor.wait_for(lambda _: latest("backups") == b"1"), monitor.messages[-8:]
    assert connack_code(primary.port) == SERVING
    assert not [m.topic for m in monitor.messages if "evil" in m.topic]
    assert "wildcard" not in primary.log(), "the $SYS topics of a name with wildcards could not be published"
    assert any(
        " WARNING " in line and f"refused a connection from {refused}" in line for line in primary.log().splitlines()
    )
    assert monitor.wait_for(lambda _: latest("refused") == b"1"), monitor.messages[-8:]  # counted in `refused`

    primary.kill()
    assert run_cli("promote", address(backup)).returncode == 0
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    device = clients(backup.port, "device")
    assert device.session_present is True
    assert [m.payload for m in device.wait_messages(40)] == payloads(20) + payloads(20, "late")
    assert any(peer in line for line in primary.log().splitlines()), "a log line names the closed connection"


TLS_REFUSED = {
    "none": "refused (retried in 5 s): the TLS channel ended before the primary's first frame (",
    "secret": "the node closed the connection during authentication: with replication.tls it may refuse this node's "
    "certificate",
}


@pytest.mark.parametrize("secret", ["none", "secret"])
def test_a_backup_whose_certificate_the_primary_refuses_logs_the_documented_reason_and_the_primary_serves_on(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Any, secret: str
) -> None:
    """On a mismatch: "A TLS failure (no certificate, wrong CA, one side without `tls`) ends the connection
    during or right after the TLS handshake ...; the node closes that socket, and the backup logs `refused
    (retried in 5 s): the TLS channel ended before the primary's first frame (...): the primary may refuse
    this node's certificate or not use TLS` (with a secret too: `the node closed the connection during
    authentication: with replication.tls it may refuse this node's certificate`)"; "the node goes on serving
    its real backups and clients". A backup with a certificate of another CA, then (without a secret: the same
    with one) a real one: the primary acknowledges throughout and the real backup is caught up."""
    pki = cluster_pki(tmp_path)
    shared = {"secret": "4f9a1c0e7b2d8a6f3e5c9b1d0a7f2e4c"} if secret == "secret" else {}
    member = {"tls": {"cert": pki["node"], "ca": pki["ca"]}, **shared}
    primary = start(node(broker_factory, "p", role="primary", **member), SERVING)
    stranger_tls = {"tls": {"cert": pki["stranger"], "ca": pki["ca"]}, **shared}
    stranger = start(node(broker_factory, "s", role="backup", primary=address(primary), **stranger_tls), BACKUP)
    expected = TLS_REFUSED[secret]
    assert stranger.wait_until(lambda: expected in stranger.log(), WAIT), stranger.log()
    line = next(line for line in stranger.log().splitlines() if expected in line)
    if secret == "secret":  # the backup, the caught-up check and the failover are the same with either: once
        assert connack_code(primary.port) == SERVING
        return
    assert "): the primary may refuse this node's certificate or not use TLS" in line, line
    queue_durable_messages(primary, clients, 10)
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary), **member), BACKUP)
    tool = ("inspect", "--replication", address(backup), "--config", str(backup.config_path))

    def caught_up() -> bool:
        return json.loads(run_cli(*tool, "--json").stdout or "{}").get("caught_up") is True

    assert backup.wait_until(caught_up, WAIT), backup.log()
    primary.kill()
    assert run_cli("promote", address(backup), "--config", str(backup.config_path)).returncode == 0
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 10)


def test_a_backup_falling_behind_shows_its_lag_in_batches_and_seconds_then_zero_once_it_acknowledges(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Watching it: the primary publishes "per backup `backup/<name>/state` (`snapshot`, `catching_up`,
    `in_sync`), `lag_batches`, `lag_seconds`" ("`lag_batches` is the newest batch's number less the backup's
    last acknowledged one; `lag_seconds`, while that is above 0, the seconds since the backup last made
    progress ..., to the millisecond, else `0.0`"), and `inspect --replication` rows read `backup b
    (HOST:PORT): in_sync, acked N, lag 0 batches / 0.0 s` (`lag 2 batches / 1.344 s` while it lags). A backup
    SIGSTOPped while publishes wait for it (sync mode, `ack_timeout` 30 s: it stays in the sync set meanwhile)
    lags by at least one batch and by more than 0 s; continued, it acknowledges, the publishes get their
    PUBACKs and its lag is 0 batches / 0.0 s again."""
    primary, backup = static_pair(broker_factory, {"metrics_interval": 0.2}, ack_timeout=30.0)
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe(SYS + "backup/b/#", 0)

    def latest(key: str) -> bytes | None:
        return _latest(monitor, "backup/b/" + key)

    queue_durable_messages(primary, clients, 1)  # a durable session: every later publish is stored for it
    publisher = clients(primary.port, "publisher2", clean_session=True)
    row = re.compile(r"  backup b \(.+\): in_sync, acked (\d+), lag (\d+) batches / (\d+\.\d{1,3}) s")

    def lag_shown() -> tuple[int, float] | None:
        lines = run_cli("inspect", "--replication", address(primary)).stdout.splitlines()
        found = next((match for line in lines if (match := row.fullmatch(line))), None)
        head = re.fullmatch(r"p: primary, at batch (\d+), sync replication", lines[0]) if lines else None
        if found is None or head is None:
            return None
        assert int(found[2]) == int(head[1]) - int(found[1]), lines  # the newest batch less the last acknowledged
        return int(found[2]), float(found[3])

    with backup.paused():
        held = [publisher.paho.publish("t/a", payload, qos=1) for payload in payloads(3, "held")]

        def lagging() -> bool:
            lag_batches, lag_seconds = latest("lag_batches"), latest("lag_seconds")
            return lag_batches is not None and int(lag_batches) >= 1 and float(lag_seconds or 0) > 0

        assert monitor.wait_for(lambda _: lagging()), monitor.messages[-8:]
        assert latest("state") == b"in_sync"
        assert not any(info.is_published() for info in held)  # each waits for the in-sync backup
        shown = lag_shown()
        assert shown is not None and shown[0] >= 1 and shown[1] > 0, shown
    for info in held:
        info.wait_for_publish(WAIT)
        assert info.is_published()
    assert monitor.wait_for(lambda _: (latest("lag_batches"), latest("lag_seconds")) in ((b"0", b"0.0"), (b"0", b"0")))
    assert wait_until(lambda: lag_shown() == (0, 0.0), WAIT), run_cli("inspect", "--replication", address(primary))
