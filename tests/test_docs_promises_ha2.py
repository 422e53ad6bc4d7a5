"""docs/replication.md's promises not pinned by test_docs_promises_ha.py: bad input to the replication
tools (`promote`, `inspect --replication`) and to broker.yaml's `replication:` settings, each
answered with an error naming the problem, and the behaviours below it, against real brokers and a
real etcd."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from replication_helpers import bounded, commit, primary_store
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

from amqtt_durable.cli import load_broker_config
from amqtt_durable.errors import ConfigError
from amqtt_durable.process import HOST, free_port
from amqtt_durable.replication.auth import Session
from amqtt_durable.replication.framing import Frame, Hello, encode_frame, encode_seq
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask
from conftest import WAIT, Broker, Client, connack_code, run_cli, tool_in_process

pytestmark = pytest.mark.timeout(120)


def _broker_yaml(folder: Path, replication: Any, name: str = "broker.yaml") -> Path:
    """A broker.yaml whose plugin section holds ``replication`` (left out when it is ...)."""
    plugin: dict[str, Any] = {"store": str(folder / "store")}
    if replication is not ...:
        plugin["replication"] = replication
    path = folder / name
    path.write_text(
        yaml.safe_dump(
            {
                "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:0"}},
                "plugins": {"amqtt_durable.DurableSessionsPlugin": plugin},
            }
        )
    )
    return path


def _tool_cases(folder: Path) -> list[tuple[list[str], int, str]]:
    closed = f"{HOST}:{free_port()}"
    short = folder / "short.secret"
    short.write_text("0123456789\n")
    broken = folder / "broken.yaml"
    broken.write_text("plugins: [\n")
    return [
        (["promote"], 2, "the following arguments are required: HOST:PORT"),
        (["promote", closed, "extra"], 2, "unrecognized arguments: extra"),
        (["promote", closed, "--secret-file"], 2, "argument --secret-file: expected one argument"),
        (["promote", "db1"], 2, "replication address 'db1': expected host:port"),
        (["promote", "127.0.0.1:0"], 2, "expected host:port"),
        (["promote", "[10.0.0.1]:7883"], 2, "expected host:port"),
        (["promote", "127.0.0.1:\uff17\uff18\uff18\uff13"], 2, "expected host:port"),  # fullwidth digits
        (["inspect", "--replication", "127.0.0.1:\u00b2"], 2, "expected host:port"),  # was int()'s own message
        (["inspect", "--replication"], 2, "argument --replication: expected one argument"),
        (["inspect", "--replication", closed, "--retained"], 2, "--retained lists a stopped broker's store"),
        (["inspect", str(folder), "--replication", closed], 2, "give a store folder (broker stopped) or --replication"),
        (["promote", closed], 1, f"replication address {closed}: no answer to PROMOTE"),
        (["inspect", "--replication", closed], 1, f"replication address {closed}: no answer to STATUS"),
        # The tools' own options are named as the tools spell them: --config, not the broker's -c.
        (["promote", closed, "--config", str(folder / "absent.yaml")], 1, "'--config': cannot read config file"),
        (["inspect", "--replication", closed, "--config", str(broken)], 1, "'--config': "),
        (["promote", closed, "--config", str(_broker_yaml(folder, ..., "single.yaml"))], 1, "no replication section"),
        (
            ["promote", closed, "--config", str(_broker_yaml(folder, {"role": "primary", "lease_ttl": 1}, "l.yaml"))],
            1,
            "'replication.lease_ttl': must be at least 2 s",
        ),
        (["promote", closed, "--secret-file", str(folder / "absent.secret")], 1, "'--secret-file': cannot read"),
        (["inspect", "--replication", closed, "--secret-file", str(short)], 1, "must be at least 16 bytes, not 10"),
    ]


def test_every_bad_argument_of_the_replication_tools_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`promote` and `inspect --replication`: a malformed HOST:PORT or a missing argument is a usage
    error (exit 2); a config, secret file or address that does not serve is exit 1 with one line
    naming the option and the problem, never a traceback. The first case of each exit status runs
    the command as a process of its own, the others its main() in this process."""
    ran: set[int] = set()
    for argv, code, words in _tool_cases(tmp_path):
        if code in ran:
            status, stderr = tool_in_process(capsys, *argv)
        else:
            ran.add(code)
            result = run_cli(*argv)
            status, stderr = result.returncode, result.stderr
        assert status == code, (argv, stderr)
        assert words in stderr, (argv, stderr)
        assert "Traceback" not in stderr, (argv, stderr)
        if code == 1:
            assert stderr.startswith("amqtt-durable: "), (argv, stderr)


def _refused(tmp_path: Path, replication: Any) -> str:
    result = run_cli("broker", "-c", str(_broker_yaml(tmp_path, replication)))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def settings_refusal(tmp_path: Path, replication: Any) -> str:
    """The ConfigError the broker command's first step, load_broker_config, raises for ``replication``
    (the command prints it and exits 2: _refused runs that for real), found in this process: a child
    interpreter per bad setting cost about half a second each."""
    with pytest.raises(ConfigError) as refused:
        load_broker_config(str(_broker_yaml(tmp_path, replication)))
    return str(refused.value)


ETCD = ["http://127.0.0.1:2379"]


@pytest.mark.parametrize(
    ("replication", "words"),
    [
        ("yes", "'replication': expected a mapping of replication settings"),
        ({"role": "primary", "Lease_ttl": 5}, "'replication.Lease_ttl': unknown setting; accepted settings are role,"),
        ({"role": "Primary"}, "'replication.role': expected one of auto, primary, backup, got 'Primary'"),
        ({"role": "primary", "mode": "SYNC"}, "'replication.mode': expected one of sync, async"),
        ({"role": "primary", "name": 5}, "'replication.name': expected text, got 5"),
        ({"role": "primary", "listen": 7883}, "'replication.listen': expected text, got 7883"),
        ({"role": "primary", "listen": "127.0.0.1:65536"}, "'replication.listen': expected host:port"),
        ({"role": "primary", "advertise": "db1"}, "'replication.advertise': expected host:port"),
        ({"role": "primary", "primary": "::1"}, "'replication.primary': "),
        ({"coordinator": ETCD, "name": "a", "primary": "127.0.0.1:7883"}, "'replication.primary': "),
        ({"coordinator": ETCD, "role": "backup", "name": "a"}, "'replication.role': must be auto with a coordinator"),
        ({"coordinator": None, "role": "primary"}, "'replication.coordinator': expected a list of URLs, got None"),
        ({"coordinator": ["https://127.0.0.1:2379"], "name": "a"}, "'replication.coordinator': expected etcd client"),
        ({"coordinator": ["http://u:p@127.0.0.1:2379"], "name": "a"}, "etcd authentication is not supported"),
        ({"coordinator": ["http://127.0.0.1:2379/v3"], "name": "a"}, "a path, query or fragment"),
        ({"role": "primary", "cluster": 7}, "'replication.cluster': expected text, got 7"),
        ({"role": "primary", "lease_ttl": "5"}, "'replication.lease_ttl': expected a whole number, got '5'"),
        ({"role": "primary", "lease_ttl": -5}, "'replication.lease_ttl': must be at least 2 s"),
        ({"role": "primary", "lease_ttl": 9_000_000_001}, "'replication.lease_ttl': must be at most 9000000000"),
        ({"role": "primary", "loop_wait": -1}, "'replication.loop_wait': must be a finite number of seconds above 0"),
        ({"role": "primary", "loop_wait": None}, "'replication.loop_wait': expected a number, got None"),
        ({"role": "primary", "demote_margin": 0}, "'replication.demote_margin': must be a finite number of seconds"),
        ({"role": "primary", "retained_batches": 1.5}, "'replication.retained_batches': expected a whole number"),
        ({"role": "primary", "retained_batches": -1}, "'replication.retained_batches': must be at least 1, got -1"),
        ({"role": "primary", "retained_bytes": -5}, "'replication.retained_bytes': must be at least 1024 bytes"),
        ({"role": "primary", "ack_timeout": 0}, "'replication.ack_timeout': must be a finite number of seconds"),
        ({"role": "primary", "ack_timeout": "5s"}, "'replication.ack_timeout': expected a number, got '5s'"),
        ({"role": "primary", "catch_up_timeout": 0}, "'replication.catch_up_timeout': must be a finite number of"),
        ({"role": "primary", "catch_up_timeout": float("inf")}, "'replication.catch_up_timeout': must be a finite"),
        ({"role": "primary", "catch_up_timeout": "60s"}, "'replication.catch_up_timeout': expected a number, got '6"),
        ({"role": "primary", "max_backups": 0}, "'replication.max_backups': must be at least 1, got 0"),
        ({"role": "primary", "max_backups": 8.0}, "'replication.max_backups': must be written as an integer (8)"),
        ({"role": "primary", "snapshot_chunk_bytes": 512}, "'replication.snapshot_chunk_bytes': must be at least 1024"),
        ({"role": "primary", "secret": 1234567890123456789}, "'replication.secret': expected text, got a value"),
        ({"role": "primary", "secret": "short"}, "'replication.secret': must be at least 16 characters"),
        ({"role": "primary", "secret_env": "1ABC"}, "'replication.secret_env': expected the name of an environment"),
        ({"role": "primary", "secret_file": "/nonexistent/x"}, "'replication.secret_file': cannot read the secret"),
        ({"role": "primary", "tls": "on"}, "'replication.tls': expected a mapping with cert, key, ca"),
        ({"role": "primary", "tls": {"cert": "/nonexistent/c.pem"}}, "'replication.tls.ca': needed with tls"),
        ({"role": "primary", "handshake_timeout": -1}, "'replication.handshake_timeout': must be a finite number"),
        ({"role": "primary", "allow_from": "10.0.0.2"}, "'replication.allow_from': expected a list of IP addresses"),
        (  # `name`: "without `/`, `+`, `#` or a control character, at most 1024 bytes of UTF-8"
            {"role": "primary", "name": "node\x1b[2J"},
            "'replication.name': 'node\\x1b[2J': a name without '/', '+', '#' or a control character, at most 1024 "
            "bytes of UTF-8",
        ),
        (  # "an unquoted entry YAML reads as a number is refused"
            {"role": "primary", "allow_from": ["127.0.0.1", 80]},
            "'replication.allow_from': expected an IP address or CIDR network, got 80 (quote it in YAML)",
        ),
    ],
)
def test_each_bad_replication_setting_stops_the_broker_naming_the_key_and_the_problem(
    tmp_path: Path, replication: Any, words: str
) -> None:
    """Settings: "checked at start-up like every other setting": wrong types, negative or out-of-range
    values, unknown keys, each named (exit code 2, configuration.md: test_a_secret_is_never_echoed_in_a_settings_error
    runs the command; these its check, settings_refusal, in this process)."""
    refusal = settings_refusal(tmp_path, replication)
    assert words in refusal, refusal


def test_a_secret_is_never_echoed_in_a_settings_error(tmp_path: Path) -> None:
    """`secret` (and `secret_env`, which may hold the secret pasted in place of a name) are never shown."""
    pasted = "4f9a1c0e7b2d8a6f3e5c9b1d0a7f2e4c"
    for replication in ({"role": "primary", "secret_env": pasted + "!"}, {"role": "primary", "secret": pasted[:9]}):
        stderr = _refused(tmp_path, replication)
        assert pasted[:9] not in stderr, stderr


# --- the keys in etcd (Design: Coordination) -------------------------------------------------------


def _etcd(etcd: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call to etcd's JSON gateway, as etcd.py makes them (and as an operator's curl would)."""
    request = urllib.request.Request(
        etcd.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _etcd_keys(etcd: Any, prefix: str) -> dict[str, bytes]:
    """Every key under ``prefix`` and its value."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    kvs = _etcd(etcd, "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)}).get("kvs") or []
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in kvs}


CLUSTER = "/amqtt-durable/amqtt-durable/"


def test_the_keys_in_etcd_are_the_documented_ones_and_a_clean_stop_revokes_a_members_entry(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Keys under /amqtt-durable/<cluster>/: ``leader`` JSON name + address (``advertise`` when set:
    "published in the leader key"), ``primary`` the same for the last node that took the lease, kept
    after it ends, ``initialize`` the node that claimed the bootstrap, ``sync``
    (sync mode) the backups the primary waits for, ``members/<name>`` JSON name, role, store_id,
    batch, candidate, address, promotion_failed, "revoked on a clean stop" (gone at once, not ``lease_ttl`` later)."""
    ha = {"coordinator": [etcd.url], "lease_ttl": 30, "loop_wait": 0.3, "demote_margin": 1}
    advertised = f"localhost:{free_port()}"  # reaches 127.0.0.1: backups dial the advertised address
    first = start(node(broker_factory, "a", **ha, listen=f"{HOST}:{advertised.rpartition(':')[2]}",
                       advertise=advertised), SERVING)  # fmt: skip
    second = start(node(broker_factory, "b", **ha), BACKUP)
    wait_status(first, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])

    def published() -> dict[str, bytes] | None:
        keys = _etcd_keys(etcd, CLUSTER)
        members = {k: json.loads(v) for k, v in keys.items() if k.startswith(CLUSTER + "members/")}
        sync = keys.get(CLUSTER + "sync")
        if [m.get("candidate") for _, m in sorted(members.items())] != [False, True] or sync is None:
            return None
        return keys if json.loads(sync)["members"] == ["b"] else None

    keys: dict[str, bytes] | None = None

    def seen() -> bool:
        nonlocal keys
        keys = published()
        return keys is not None

    assert first.wait_until(seen, 20), _etcd_keys(etcd, CLUSTER)
    assert keys is not None
    names = ("leader", "primary", "initialize", "sync", "members/a", "members/b")
    assert set(keys) == {CLUSTER + name for name in names}
    assert json.loads(keys[CLUSTER + "leader"]) == {"name": "a", "address": advertised}
    assert json.loads(keys[CLUSTER + "primary"]) == {"name": "a", "address": advertised}
    assert keys[CLUSTER + "initialize"] == b"a"
    a, b = (json.loads(keys[CLUSTER + f"members/{name}"]) for name in "ab")
    assert set(a) == set(b) == {"name", "role", "store_id", "batch", "candidate", "address", "promotion_failed"}
    assert a["promotion_failed"] is b["promotion_failed"] is False
    assert a["address"] == advertised  # each member's replication address (One name, one backup)
    assert (a["name"], a["role"], b["name"], b["role"]) == ("a", "primary", "b", "backup")
    assert a["store_id"] == b["store_id"] and isinstance(b["batch"], int)

    second.terminate()
    assert second.wait_stopped(time.monotonic() + 15), second.log()
    remaining = _etcd_keys(etcd, CLUSTER + "members/")
    assert set(remaining) == {CLUSTER + "members/a"}, remaining  # its 30 s member lease was revoked


def test_the_initialize_claim_is_permanent_until_deleted_by_hand_then_the_next_empty_node_bootstraps(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Coordination: "every later node finds the claim and waits for a primary to follow ("not caught
    up with the last one")"; the claim is permanent; "delete the claim by hand (etcdctl del
    /amqtt-durable/<cluster>/initialize) and the next empty node bootstraps"."""
    ha = {"coordinator": [etcd.url], "cluster": "c1", **HA_TIMING}
    prefix = "/amqtt-durable/c1/"
    claimed = {"key": _b64(prefix + "initialize"), "value": _b64("ghost")}  # claimed by a node that died
    _etcd(etcd, "/v3/kv/put", claimed)
    waiting = start(node(broker_factory, "a", **ha), BACKUP)
    assert waiting.wait_until(lambda: "not caught up with the last one" in waiting.log(), 20), waiting.log()
    shown = wait_status(waiting, lambda s: [m["name"] for m in s.get("members", [])] == ["a"])
    assert (shown["role"], shown["caught_up"]) == ("backup", False)
    assert connack_code(waiting.port) == BACKUP  # several cycles later: still waiting
    assert _etcd_keys(etcd, prefix + "initialize") == {prefix + "initialize": b"ghost"}
    assert "now primary" not in waiting.log()

    _etcd(etcd, "/v3/kv/deleterange", {"key": _b64(prefix + "initialize")})  # etcdctl del ...
    assert waiting.wait_until(lambda: connack_code(waiting.port) == SERVING, 20), waiting.log()
    assert "a new cluster, claimed its bootstrap: took the leader lease, now primary" in waiting.log()
    assert _etcd_keys(etcd, prefix + "initialize") == {prefix + "initialize": b"a"}


# --- catching a returning backup up: the retained log or a snapshot ---------------------------------


@pytest.mark.parametrize(
    ("retained", "plan"),
    [
        ({}, r"the backup is \d+ batches behind; sent from the log"),
        ({"retained_batches": 2}, r"the backup is at batch \d+, too far behind: the retained log starts at \d+"),
        ({"retained_bytes": 1024}, r"the backup is at batch \d+, too far behind: the retained log starts at \d+"),
    ],
)
def test_a_returning_backup_is_caught_up_from_the_retained_log_while_its_position_is_there_else_by_snapshot(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], retained: dict[str, int], plan: str
) -> None:
    """A backup that comes back after a restart is caught up "from the primary's retained log of
    recent batches (retained_batches, retained_bytes) when its position is still there, otherwise
    from a snapshot"; either way it ends in_sync holding every acknowledged publish."""
    primary = start(node(broker_factory, "p", role="primary", **retained), SERVING)
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary)), BACKUP)
    head = wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])["batch"]
    wait_status(backup, lambda s: s["caught_up"] and s["batch"] >= head)  # its store holds the snapshot
    backup.terminate()
    assert backup.wait_stopped(time.monotonic() + 15), backup.log()
    wait_status(primary, lambda s: s["backups"] == [])
    queue_durable_messages(primary, clients, 40)  # 40 PUBACKs, each after its own commit: many batches

    start(backup, BACKUP)
    head = wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])["batch"]
    lines = [
        line for line in primary.log().splitlines() if "replication: backup b (" in line and "connected at" in line
    ]
    assert re.search(plan, lines[-1]), (lines, backup.log())
    wait_status(backup, lambda s: s["batch"] == head)
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, 15), backup.log()
    assert_queue_served(backup, clients, 40)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lost_backup_holds_sync_pubacks_for_ack_timeout_then_the_primary_goes_on_and_catches_it_up(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], mode: str
) -> None:
    """What each mode guarantees, "Backup lost": sync, "the primary goes on after ack_timeout without
    it, and catches it up when it returns"; async, "no effect on acknowledgements". Watching it: a
    backup that "stops acknowledging for ack_timeout" is logged as a WARNING by the primary."""
    primary, backup = static_pair(broker_factory, mode=mode, ack_timeout=2)
    subscriber = clients(primary.port, "device")  # a durable session: each publish is stored for it
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    publisher = clients(primary.port, "publisher", clean_session=True)
    publisher.publish("t/before", [b"stored on 2 machines"])
    with backup.paused():
        held = publisher.paho.publish("t/during", b"held", qos=1)
        held.wait_for_publish(1.0)
        if mode == "sync":
            assert not held.is_published()  # the in-sync backup has not stored it: no PUBACK yet
            held.wait_for_publish(WAIT)
        assert held.is_published()  # sync: ack_timeout later the primary went on without it
        if mode == "sync":
            warned = [line for line in primary.log().splitlines() if "no ack for 2 s: disconnected" in line]
            assert warned and " WARNING " in warned[0] and "replication: backup b (" in warned[0], primary.log()
        publisher.publish("t/alone", [b"acknowledged by the primary alone"])
    head = wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])["batch"]
    assert wait_status(backup, lambda s: s["batch"] >= head)["caught_up"]
    backup_has = run_cli("promote", address(backup))  # what it holds: all three, in order
    assert backup_has.returncode == 0, backup_has.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, 15), backup.log()
    device = clients(backup.port, "device")
    got = [m.payload for m in device.wait_messages(3)]
    assert got == [b"stored on 2 machines", b"held", b"acknowledged by the primary alone"], got


def test_a_backup_sent_a_snapshot_is_in_sync_only_once_it_acknowledged_it(tmp_path: Path) -> None:
    """Replacing a dead machine: "watch it with inspect --replication until its row says in_sync";
    Protocol 5: from IN_SYNC on "the backup counts for sync mode". A backup's receive queue holds up
    to 1,024 frames (a GiB of 1 MiB snapshot chunks), so a backup may apply a snapshot for seconds
    after the primary sent its last chunk: its row said in_sync (and sync publishes waited for it,
    until ack_timeout dropped it) while its store still lacked the snapshot. Now the row says
    catching_up, and a commit is acknowledged without that backup, until it acknowledges the
    snapshot's batch."""

    async def main() -> None:
        db, store_id = primary_store(tmp_path / "p")
        primary = Primary(db, store_id=store_id, log_max_batches=1000, log_max_bytes=64 << 20, ack_timeout=60)
        await primary.start(HOST, 0)
        for n in range(1, 6):
            await bounded(commit(primary, [(b"m" + n.to_bytes(8, "big"), b"x" * 100)]))
        reader, writer = await asyncio.open_connection(HOST, primary.port)  # reads all, applies nothing yet
        writer.write(encode_frame(Frame.HELLO, Hello(1, 0, 0, "new").encode()))  # a new, empty store
        await writer.drain()
        session = Session(None)
        kinds: list[Frame] = []
        async with asyncio.timeout(30):
            while Frame.SNAP_END not in kinds:
                kinds.append((await session.read(reader))[0])
        assert [row["state"] for row in primary.status()] == ["catching_up"]
        assert Frame.IN_SYNC not in kinds
        unconfirmed = commit(primary, [(b"m" + (6).to_bytes(8, "big"), b"y")])
        await bounded(unconfirmed)  # the backup does not count yet: the primary acknowledges alone
        kinds = [(await bounded(session.read(reader)))[0]]  # batch 6
        writer.write(session.encode(Frame.ACK, encode_seq(5)))  # the snapshot (batch 5) is applied
        await writer.drain()
        async with asyncio.timeout(30):
            while Frame.IN_SYNC not in kinds:
                kinds.append((await session.read(reader))[0])
        assert [row["state"] for row in primary.status()] == ["in_sync"]
        waiting = commit(primary, [(b"m" + (7).to_bytes(8, "big"), b"z")])
        await asyncio.sleep(0)  # (one loop pass: not a synchronisation, the future must stay open)
        assert not waiting.done()  # in sync now: batch 7 waits for the backup
        writer.write(session.encode(Frame.ACK, encode_seq(6)))
        writer.write(session.encode(Frame.ACK, encode_seq(7)))
        await writer.drain()
        await bounded(waiting)
        writer.close()
        await primary.close()
        db.close()

    asyncio.run(main())


def test_a_store_without_a_replication_position_started_as_primary_waits_for_the_snapshots_ack(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The same promise for a snapshot "at batch 0": a single broker's store (rows, no replication
    position) restarted as role: primary snapshots at batch 0 until its first commit. The primary
    took snapshot batch 0 for "no snapshot sent" and said IN_SYNC right after SNAP_END, before any
    acknowledgement: the row said in_sync while the backup had applied nothing."""
    single = broker_factory(start=False, name="p")
    start(single, SERVING)
    queue_durable_messages(single, clients, 300)
    single.terminate()
    assert single.wait_stopped(time.monotonic() + WAIT), single.log()
    single.settings["replication"] = {"name": "p", "role": "primary", "listen": f"{HOST}:{free_port()}"}
    start(single, SERVING)
    host, port = address(single).rsplit(":", 1)

    async def main() -> None:
        assert (await ask(address(single), Frame.STATUS))["batch"] == 0  # no replication position yet
        reader, writer = await asyncio.open_connection(host, int(port))  # reads all, applies nothing yet
        writer.write(encode_frame(Frame.HELLO, Hello(1, 0, 0, "new").encode()))  # a new, empty store
        await writer.drain()
        session = Session(None)
        kinds: list[Frame] = []
        async with asyncio.timeout(WAIT):
            while Frame.SNAP_END not in kinds:
                kinds.append((await session.read(reader))[0])
        row = (await ask(address(single), Frame.STATUS))["backups"]
        assert [(r["state"], r["acked"]) for r in row] == [("catching_up", 0)], row
        writer.write(session.encode(Frame.ACK, encode_seq(0)))  # the snapshot (batch 0) is applied
        await writer.drain()
        async with asyncio.timeout(WAIT):
            while Frame.IN_SYNC not in kinds:
                kinds.append((await session.read(reader))[0])
        row = (await ask(address(single), Frame.STATUS))["backups"]
        assert [r["state"] for r in row] == ["in_sync"], row
        writer.close()

    asyncio.run(main())
    backup = start(node(broker_factory, "b", role="backup", primary=address(single)), BACKUP)
    wait_status(backup, lambda s: s["caught_up"])
    single.kill()
    assert run_cli("promote", address(backup)).returncode == 0
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 300)


def test_a_backup_without_a_name_is_backup_in_its_primarys_status_and_sys_topics(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Settings, ``name``: "a backup without one is ``backup`` in its primary's status and ``$SYS``
    topics"; Watching it: ``backup/<name>/state`` is ``in_sync`` once it is."""
    primary = start(node(broker_factory, "p", {"metrics_interval": 0.2}, role="primary"), SERVING)
    unnamed = {"role": "backup", "primary": address(primary), "listen": f"{HOST}:{free_port()}"}
    start(broker_factory(start=False, name="b", replication=unnamed), BACKUP)
    wait_status(primary, lambda s: [(row["name"], row["state"]) for row in s["backups"]] == [("backup", "in_sync")])
    shown = run_cli("inspect", "--replication", address(primary))
    assert shown.returncode == 0, shown.stderr
    assert re.fullmatch(rf"  backup backup \({re.escape(HOST)}:\d+\): in_sync, acked \d+, lag \d+ batches / .* s",
                        shown.stdout.splitlines()[1]), shown.stdout  # fmt: skip
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe("$SYS/broker/durable/replication/backup/+/state", 0)
    assert monitor.wait_for(lambda got: any(m.payload == b"in_sync" for m in got)), monitor.messages
    assert {m.topic for m in monitor.messages} == {"$SYS/broker/durable/replication/backup/backup/state"}


def test_a_second_broker_with_the_primarys_name_says_the_names_clash(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Settings, ``name``: "this broker's unique name in the cluster". A second broker given the
    primary's name took the leader key naming it for its own from before a restart, and waited, at
    INFO, "for it to end" (never, while the primary lives): now it says, at ERROR, that another
    broker holds the lease under its name, and stays a backup."""
    ha = {"coordinator": [etcd.url], **HA_TIMING}
    start(node(broker_factory, "a", **ha), SERVING)
    twin = start(broker_factory(start=False, name="twin", replication={"name": "a", "listen": f"{HOST}:{free_port()}",
                                                                       **ha}), BACKUP)  # fmt: skip
    said = "another broker holds the leader lease under this node's name, a"
    assert twin.wait_until(lambda: said in twin.log(), 20), twin.log()
    line = next(line for line in twin.log().splitlines() if said in line)
    assert " ERROR " in line and "names must be unique in the cluster" in line, line
    assert connack_code(twin.port) == BACKUP
