"""Black-box checks of docs/replication.md, README.md's "High availability" and docs/fleet.md's
``--ha`` parts that no other test pins: real broker processes on 127.0.0.1 ports, a real etcd, real
paho clients and the real ``amqtt-durable`` command. Each test quotes the promise it checks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet_helpers import processes_in, signal_fleet_when
from raw_mqtt_helpers import connect_packet, read_exactly
from test_docs_promises_ha2 import CLUSTER, _b64, _etcd
from test_ha_brokers import (
    BACKUP,
    FAILOVER_WAIT,
    HA_TIMING,
    SERVING,
    address,
    ha_pair,
    node,
    start,
    static_pair,
    wait_status,
)
from test_ha_brokers import status as node_status
from test_ha_partition import in_sync_set

from amqtt_durable.cli import load_broker_config
from amqtt_durable.errors import ConfigError
from amqtt_durable.process import HOST, free_port
from amqtt_durable.replication.framing import Frame, encode_frame, read_frame
from amqtt_durable.store import open_store
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli
from durable_client import DurableClient, Event
from durable_fleet.proxy import TcpRelay

pytestmark = pytest.mark.timeout(120)

SECRET = "4f9a1c0e7b2d8a6f3e5c9b1d0a7f2e4c"


def _broker_yaml(folder: Path, replication: dict[str, Any]) -> Path:
    """A broker.yaml in ``folder``: one TCP listener on a free port, the store in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "broker.yaml"
    plugin = {"store": str(folder / "store"), "replication": replication}
    listeners = {"default": {"type": "tcp", "bind": f"{HOST}:{free_port()}"}}
    config = {"listeners": listeners, "plugins": {"amqtt_durable.DurableSessionsPlugin": plugin}}
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def _listening(port: int) -> Iterator[socket.socket]:
    """Another process's server on ``port`` (here, this test's socket)."""
    with socket.socket() as taken:
        taken.bind((HOST, port))
        taken.listen()
        yield taken


@pytest.mark.parametrize("role", ["primary", "backup"])
def test_a_replication_address_in_use_at_start_stops_the_broker_naming_it(tmp_path: Path, role: str) -> None:
    """Promotion binds no port: "the replication address (`listen`) is bound once at start ... (a port in use at start
    stops the broker: `broker not started: replication.listen ADDRESS: REASON`)" (operations.md: exit 1 when the
    broker cannot start, ``replication.listen``'s port in use included)."""
    port = free_port()
    replication: dict[str, Any] = {"role": role, "listen": f"{HOST}:{port}"}
    if role == "backup":
        replication["primary"] = f"{HOST}:{free_port()}"
    config = _broker_yaml(tmp_path, replication)
    with _listening(port):
        result = run_cli("broker", "-c", str(config))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    expected = f"amqtt-durable: broker not started: replication.listen {HOST}:{port}: [Errno 98] Address already in use"
    assert last == expected, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "qos"), [("sync", 1), ("sync", 2), ("async", 1), ("async", 2)])
def test_a_durable_subscriber_gets_a_publish_in_sync_mode_only_once_the_backup_stored_it_in_async_at_once(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], mode: str, qos: int
) -> None:
    """What each mode guarantees, "A message reaches subscribers": sync, "a durable session: after the
    same confirmation, so nothing is delivered to it that a failover could take back; a clean-session
    subscriber: a QoS 0 or 1 publish as it is routed, a QoS 2 one after its PUBREL, which follows the
    PUBREC that the confirmation holds back"; async, "a durable session: after the local commit". The
    backup is SIGSTOPped. Sync (ack_timeout 2 s): neither the PUBACK/PUBCOMP nor the durable delivery
    (nor, for QoS 2, the clean one) arrives before ack_timeout drops the backup (load can delay them,
    never make them early); a QoS 1 publish reaches the clean subscriber before its PUBACK. Async
    (ack_timeout 30 s, longer than any wait here): all of them arrive while the backup sleeps."""
    ack_timeout = 2 if mode == "sync" else 30
    primary, backup = static_pair(broker_factory, mode=mode, ack_timeout=ack_timeout)
    durable = clients(primary.port, "device")
    clean = clients(primary.port, "watcher", clean_session=True)
    for subscriber in (durable, clean):
        subscriber.subscribe("t/#", 1)
    publisher = clients(primary.port, "publisher", clean_session=True)
    publisher.publish("t/before", [b"both stored it"], qos=qos)
    for subscriber in (durable, clean):
        assert [m.payload for m in subscriber.wait_messages(1)] == [b"both stored it"]
    acked: list[float] = []  # when the PUBACK (QoS 2: the PUBCOMP) arrived, in paho's network thread
    publisher.paho.on_publish = lambda *_: acked.append(time.monotonic())
    with backup.paused():
        t_pub = time.monotonic()
        sent = publisher.paho.publish("t/during", b"while the backup sleeps", qos=qos)
        sent.wait_for_publish(ack_timeout + WAIT)
        assert sent.is_published()
        got = {name: who.wait_messages(2)[-1] for name, who in (("durable", durable), ("clean", clean))}
    assert [m.payload for m in got.values()] == [b"while the backup sleeps"] * 2
    arrived = {"PUBACK": acked[-1], **{name: m.timestamp for name, m in got.items()}}  # paho's monotonic stamps
    after = {name: round(at - t_pub, 3) for name, at in arrived.items()}
    if mode == "async":
        assert all(took < ack_timeout for took in after.values()), after  # nobody waited for the backup
        return
    held = ["PUBACK", "durable"] + (["clean"] if qos == 2 else [])
    assert all(after[name] >= ack_timeout - 0.1 for name in held), after
    if qos == 1:
        assert arrived["clean"] < arrived["PUBACK"], after  # as it is routed


def test_a_fixed_role_backup_waits_for_the_operator_and_then_resends_what_was_in_flight_with_dup(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Without a coordinator: "The primary never steps down by itself and a backup never takes over
    by itself." Clients: "On the new primary a durable session gets `session_present=1`, its whole
    queue, and DUP on what was in flight"; sync mode: "nothing acknowledged is lost; in-flight
    messages come again from the new primary, with DUP where its copy holds their sent mark"."""
    primary, backup = static_pair(broker_factory)
    device = clients(primary.port, "device", manual_ack=True)  # receives, never acknowledges
    device.subscribe("t/#", 1)
    publisher = clients(primary.port, "publisher", clean_session=True)
    sent = payloads(5, "inflight")
    publisher.publish("t/a", sent)
    assert [m.payload for m in device.wait_messages(5)] == sent
    assert not any(m.dup for m in device.messages)
    publisher.publish("t/a", payloads(3, "queued"))  # beyond none: queued behind the in-flight ones
    assert device.wait_messages(8)[-1].payload == payloads(3, "queued")[-1]

    primary.kill()
    wait_status(backup, lambda s: s["state"] == "disconnected")  # it saw its primary go
    assert connack_code(backup.port) == BACKUP, "a fixed-role backup took over by itself"
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()

    again = clients(backup.port, "device", manual_ack=True)
    assert again.session_present is True
    got = again.wait_messages(8)
    assert [m.payload for m in got] == sent + payloads(3, "queued")
    assert all(m.dup for m in got), [(m.payload, m.dup) for m in got]


def test_a_failed_promotion_of_a_fixed_role_backup_is_logged_shown_by_inspect_and_it_stays_a_backup(
    broker_factory: Callable[..., Broker],
) -> None:
    """Without a coordinator: "`promote` answers once the promotion has started, before the store is loaded. A
    promotion that fails after that (the store does not load) is logged as an ERROR (`the promotion failed: REASON;
    still a backup`); the node stays a backup, follows `primary` again, and its replication address keeps answering:
    `inspect --replication` shows `its last promotion failed: REASON`"."""
    gone = f"{HOST}:{free_port()}"
    backup = node(broker_factory, "b", role="backup", primary=gone)
    Path(backup.store).parent.mkdir(parents=True, exist_ok=True)
    db = open_store(backup.store)
    db.put(b"sbroken-device", b"\xff not a session record")  # a damaged session record
    db.close()
    start(backup, BACKUP)

    answered = run_cli("promote", address(backup))
    assert answered.returncode == 0, answered.stderr
    failed = "the promotion failed: "
    assert backup.wait_until(lambda: failed in backup.log(), WAIT), backup.log()
    line = next(line for line in backup.log().splitlines() if failed in line)
    assert " ERROR " in line and line.rstrip().endswith("; still a backup") and "broken-device" in line, line
    reason = line.split(failed, 1)[1].rsplit("; still a backup", 1)[0]

    shown = run_cli("inspect", "--replication", address(backup))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("b: backup, at batch "), lines
    assert lines[1].startswith(f"  following {gone}: "), lines
    assert f"  its last promotion failed: {reason}" in lines, lines
    assert connack_code(backup.port) == BACKUP


def test_the_coordinators_urls_are_tried_in_order(broker_factory: Callable[..., Broker], etcd: Any) -> None:
    """Settings, ``coordinator``: "etcd client URLs (`http://host:2379`; port 2379 when left out ...),
    tried in order": a first URL where nothing listens does not keep the node from etcd at the second."""
    dead = f"http://{HOST}:{free_port()}"
    first = start(node(broker_factory, "a", coordinator=[dead, etcd.url], **HA_TIMING), SERVING)
    wait_status(first, lambda s: [(m["name"], m["role"]) for m in s.get("members", [])] == [("a", "primary")])


def _etcd_key(etcd: Any, key: str) -> dict[str, Any] | None:
    """The key's record in etcd (value, version, lease, ...), None when absent."""
    kvs = _etcd(etcd, "/v3/kv/range", {"key": _b64(CLUSTER + key)}).get("kvs") or []
    return kvs[0] if kvs else None


def _lease_left(etcd: Any, key: str) -> tuple[float, int]:
    """When we asked (time.monotonic, before the question) and the whole seconds etcd said were left
    of the lease ``key`` is written under (it counts down from the lease's last renewal)."""
    asked = time.monotonic()
    entry = _etcd_key(etcd, key)
    assert entry is not None and "lease" in entry, entry
    return asked, int(_etcd(etcd, "/v3/lease/timetolive", {"ID": entry["lease"]})["TTL"])


@pytest.mark.slow
def test_failover_waits_for_the_lease_and_ends_within_lease_ttl_plus_loop_wait(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Start a pair with etcd: "Failover time is at most `lease_ttl` (the lease expires) + `loop_wait` (the backup's
    next check) + promotion + the client's reconnect" (README: "serves ... 2 to 3 s later with short lease
    settings"); "No split brain": nobody else can be primary before the lease could have ended, that is
    ``lease_ttl`` after the last renewal, which was at most ``loop_wait`` before the kill. Bounds here: at least
    what etcd said was left of the leader lease just before the kill (renewals late under load only make it less
    than lease_ttl - loop_wait), from that question; at most lease_ttl + loop_wait + 4 s after the kill (promotion,
    the CONNECT probe every 0.1 s, a loaded 2-core machine)."""
    first, second = ha_pair(broker_factory, etcd)
    wait_status(first, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])
    asked, left = _lease_left(etcd, "leader")
    killed = time.monotonic()
    first.kill()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    done = time.monotonic()
    ttl, loop_wait = HA_TIMING["lease_ttl"], HA_TIMING["loop_wait"]
    assert done - asked >= left, (done - asked, left)
    assert done - killed <= ttl + loop_wait + 4.0, done - killed
    assert "now primary" in second.log(), second.log()


class _ErrorNode:
    """A fake node on a replication address: whatever a tool asks, it answers one ERROR frame with
    ``text`` (or one ``frame`` of another kind) and closes (as a node refusing a connection does)."""

    def __init__(self, text: bytes, frame: Frame = Frame.ERROR) -> None:
        self.text = text
        self.frame = frame
        self.port = free_port()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(read_frame(reader), WAIT)
            writer.write(encode_frame(self.frame, self.text))
            await writer.drain()
        writer.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._answer, HOST, self.port)
        self.ready.set()
        async with server:
            await asyncio.to_thread(self.stop.wait, 4 * WAIT)

    def __enter__(self) -> _ErrorNode:
        self.thread.start()
        assert self.ready.wait(WAIT)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(WAIT)


def test_a_peers_error_text_is_shown_escaped_and_cut_at_200_characters(tmp_path: Path) -> None:
    """Securing the channel: "A peer's ERROR text is shown (in the log, by the tools) with characters that are not
    printable escaped (`\\n`, `\\x1b`) and cut at 200 characters"; "A tool prints the same reason and exits with
    status 1"."""
    text = "bad\n\x1b[2J" + "y" * 400
    with _ErrorNode(text.encode()) as fake:
        for argv in (["inspect", "--replication"], ["promote"]):
            result = run_cli(*argv, f"{HOST}:{fake.port}")
            assert result.returncode == 1, result.stderr
            assert "\x1b" not in result.stderr and len(result.stderr.splitlines()) == 1, repr(result.stderr)
            reason = result.stderr.split("refused: ", 1)[1].rstrip("\n")
            assert reason.startswith("bad\\n\\x1b[2Jyyy"), reason
            shown = reason.split("...", 1)[0]
            assert len(shown) == 200, (len(shown), reason)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"not json", "not UTF-8 JSON: Expecting value"),
        (b"[1]", "not a JSON object but an array"),
        (b"[" * 100_000, "JSON nested too deeply"),
    ],
    ids=["text", "list", "nested"],
)
@pytest.mark.parametrize(
    ("argv", "frame"), [(["inspect", "--replication"], Frame.STATUS), (["promote"], Frame.PROMOTE)]
)
def test_an_answer_that_is_not_a_json_object_is_one_line_naming_the_address(
    argv: list[str], frame: Frame, answer: bytes, reason: str
) -> None:
    """A node's STATUS or PROMOTE answer that is not a JSON object (text, a list, JSON nested past the
    interpreter's limit: a RecursionError traceback, as other text gave a JSONDecodeError one) is one line
    naming the address, and the tool exits with status 1 as for a peer's refusal."""
    with _ErrorNode(answer, frame) as fake:
        result = run_cli(*argv, f"{HOST}:{fake.port}")
    assert result.returncode == 1, result.stderr
    expected = f"replication address {HOST}:{fake.port}: its answer to {frame.name} is not readable: {reason}"
    assert expected in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("argv", "frame", "answer", "wrong"),
    [
        (["inspect", "--replication"], Frame.STATUS, b"{}", "is not one this version shows (no 'role')"),
        (
            ["inspect", "--replication"],
            Frame.STATUS,
            b'{"role": "backup", "batch": 1, "state": "x", "members": 5}',
            "is not one this version shows (TypeError: 'int' object is not iterable)",
        ),
        (["promote"], Frame.PROMOTE, b"{}", "is not readable: no 'promoted'"),
        (
            ["promote"],
            Frame.PROMOTE,
            b'{"promoted": 1, "why": "x"}',
            "is not readable: 'promoted' is not a boolean: a number 1",
        ),
        (["promote"], Frame.PROMOTE, b'{"promoted": false, "why": 1e999}', "is not readable: 1e999 is past a float"),
    ],
    ids=["status-empty", "status-members-number", "promote-empty", "promote-int", "promote-1e999"],
)
def test_an_answer_without_its_fields_is_one_line_naming_the_address(
    argv: list[str], frame: Frame, answer: bytes, wrong: str
) -> None:
    """replication.md: a node's STATUS or PROMOTE answer that is a JSON object without the fields the tool
    shows, or with fields of other types (a KeyError or TypeError traceback), is one line naming the
    address and what is wrong, exit status 1."""
    with _ErrorNode(answer, frame) as fake:
        result = run_cli(*argv, f"{HOST}:{fake.port}")
    assert result.returncode == 1, result.stderr
    expected = f"replication address {HOST}:{fake.port}: its answer to {frame.name} {wrong}"
    assert expected in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("argv", "frame", "answer", "out", "lines"),
    [
        (["inspect", "--replication"], Frame.STATUS, b'{"role": "backup", "batch": 1, "state": "\\ud800\\nx"}', 1, 2),
        (["promote"], Frame.PROMOTE, b'{"promoted": true, "why": "\\ud800\\nx"}', 1, 1),
        (["promote"], Frame.PROMOTE, b'{"promoted": false, "why": "\\ud800\\nx"}', 2, 1),
        (  # a field of a row in a list, as deep as the tool reads (review 326)
            ["inspect", "--replication"],
            Frame.STATUS,
            b'{"role": "backup", "batch": 1, "state": "s", "members": [{"name": "\\ud800\\nx", "role": "backup", '
            b'"batch": 1, "store_id": 1, "candidate": false}]}',
            1,
            4,
        ),
    ],
    ids=["status", "promoted", "not-promoted", "status-member-row"],
)
def test_a_nodes_text_that_print_cannot_encode_or_that_splits_a_line_is_shown_escaped(
    argv: list[str], frame: Frame, answer: bytes, out: int, lines: int
) -> None:
    """Review 325: a lone surrogate in a node's STATUS or PROMOTE answer (a UnicodeEncodeError traceback from
    print) or a newline (a line the node forged) is shown escaped, as inspect shows a client's text: the
    tool's lines stay its own."""
    with _ErrorNode(answer, frame) as fake:
        result = run_cli(*argv, f"{HOST}:{fake.port}")
    shown, other = (result.stdout, result.stderr) if out == 1 else (result.stderr, result.stdout)
    assert result.returncode == (0 if out == 1 else 1) and not other, result
    assert "\\ud800\\nx" in shown and len(shown.splitlines()) == lines, shown


def test_a_relative_secret_file_is_read_from_the_working_directory_not_broker_yamls_folder(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """Securing the channel, the tools: "A relative path in broker.yaml (`secret_file`, `tls.cert`, `.key`, `.ca`, like
    `store`) is read from the working directory of the process, the broker's and the tool's alike, not from
    broker.yaml's folder: run the tool from the broker's working directory, or give absolute paths"."""
    secret = tmp_path / "secrets" / "replication.secret"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    relative = os.path.relpath(secret, Path.cwd())  # the broker runs in this process's directory
    primary = start(node(broker_factory, "p", role="primary", secret_file=relative), SERVING)

    tool_config = tmp_path / "conf" / "broker.yaml"
    tool_config.parent.mkdir()
    tool_config.write_text(
        yaml.safe_dump(
            {
                "plugins": {
                    "amqtt_durable.DurableSessionsPlugin": {
                        "store": "store",
                        "replication": {"role": "primary", "secret_file": "replication.secret"},
                    }
                }
            }
        )
    )
    (tool_config.parent / "replication.secret").write_text("not the cluster's secret, but 16+\n")

    from_secrets = run_cli("inspect", "--replication", address(primary), "--config", str(tool_config),
                           cwd=secret.parent)  # fmt: skip
    assert from_secrets.returncode == 0, from_secrets.stderr
    assert from_secrets.stdout.startswith("p: primary, at batch "), from_secrets.stdout

    from_conf = run_cli("inspect", "--replication", address(primary), "--config", str(tool_config), cwd=tmp_path)
    assert from_conf.returncode == 1, from_conf.stdout
    assert "'replication.secret_file': cannot read" in from_conf.stderr, from_conf.stderr


def test_fleet_refuses_a_schedule_whose_primary_kill_and_partition_overlap(tmp_path: Path) -> None:
    """fleet.md, ``--ha``: "Random primary kills and partitions never overlap ...; in a script they must
    not either"; "A bad schedule ... stops the run before it starts, with exit status 2 and the file,
    fault number and field named"."""
    (tmp_path / "broker.yaml").write_text((Path(__file__).parent.parent / "broker.yaml").read_text())
    schedule = tmp_path / "overlap.yaml"
    faults = [{"at": "8s", "kind": "primary_kill", "for": "4s"}, {"at": "10s", "kind": "partition", "for": "4s"}]
    schedule.write_text(yaml.safe_dump({"faults": faults}))
    result = run_cli("fleet", "--ha", "--schedule", str(schedule), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert str(schedule) in result.stderr and "overlap" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "etcd").exists()  # stopped before it started anything


@pytest.mark.parametrize(
    ("replication", "key", "words"),
    [
        ({"role": "primary", "name": "a#"}, "name", "#"),
        ({"role": "primary", "name": "a\x00b"}, "name", "control character"),
        ({"role": "primary", "cluster": "a/b"}, "cluster", "/"),
        ({"role": "primary", "lease_ttl": 2.5, "loop_wait": 0.5, "demote_margin": 0.5}, "lease_ttl", "whole"),
        ({"role": "primary", "lease_ttl": 5, "demote_margin": 5, "loop_wait": 0.1}, "demote_margin", "below"),
        ({"role": "primary", "snapshot_chunk_bytes": 134217729}, "snapshot_chunk_bytes", "134217728"),
        ({"role": "backup", "listen": "127.0.0.1:7999", "primary": "127.0.0.1:7999"}, "primary", "listen"),
        (
            {
                "role": "backup",
                "listen": "127.0.0.1:7999",
                "advertise": "db1.example:7883",
                "primary": "DB1.example:7883",
            },
            "primary",
            "advertise",
        ),
        ({"coordinator": ["http://127.0.0.1:0"], "name": "a"}, "coordinator", "127.0.0.1:0"),
        ({"coordinator": ["http://127.0.0.1:70000"], "name": "a"}, "coordinator", "70000"),
        ({"coordinator": ["http://127.0.0.1:2379?x=1"], "name": "a"}, "coordinator", "query"),
        ({"coordinator": ["http://127.0.0.1:2379#f"], "name": "a"}, "coordinator", "fragment"),
        ({"coordinator": ["http://[::1:2379"], "name": "a"}, "coordinator", "[::1:2379"),
        ({"coordinator": ["http://\u00e9tcd.example:2379"], "name": "a"}, "coordinator", "xn--"),
    ],
)
def test_replication_settings_the_table_refuses_are_refused_naming_the_key(
    tmp_path: Path, replication: dict[str, Any], key: str, words: str
) -> None:
    """Settings ("checked at start-up like every other setting"; configuration.md: exit code 2, the key
    named): ``name`` "without `/`, `+`, `#` or a control character"; ``cluster`` "not empty, without `/`";
    ``lease_ttl`` "whole seconds"; ``demote_margin`` "below `lease_ttl`"; ``snapshot_chunk_bytes`` "at
    most 134217728"; ``primary`` "not its own `listen` or `advertise` (compared as written but for the
    host's case ...)"; ``coordinator``: "a malformed entry (an unclosed
    bracket, a port that is not a number from 1 to 65535, a host in non-ASCII characters: write an
    internationalised name in its `xn--` form) is refused at start, naming it, and so is one with ... a
    path, a query or a fragment"."""
    # broker.yaml's check as `amqtt-durable broker -c` runs it before amqtt starts (the CLI run, exit code 2,
    # costs seconds each: test_a_refused_replication_setting_stops_the_broker_with_exit_2 runs it for two).
    with pytest.raises(ConfigError) as refused:
        load_broker_config(str(_broker_yaml(tmp_path, replication)))
    assert refused.value.key == f"replication.{key}" and words in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("replication", "words"),
    [
        ({"role": "primary", "cluster": ""}, "'replication.cluster': expected a name, not empty and without '/'"),
        ({"role": "primary", "name": "dev+1"}, "'replication.name': 'dev+1': a name without '/', '+', '#'"),
    ],
)
def test_a_refused_replication_setting_stops_the_broker_with_exit_2(
    tmp_path: Path, replication: dict[str, Any], words: str
) -> None:
    """configuration.md: a bad setting "stops the broker with an error that names the key (exit code 2)";
    ``cluster`` "not empty" (an empty one was refused as "expected a name without '/', got ''", which it is)."""
    result = run_cli("broker", "-c", str(_broker_yaml(tmp_path, replication)))
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


def _durable_connack(port: int, client_id: str) -> bytes:
    """The CONNACK (4 bytes) a durable CONNECT of ``client_id`` gets; the connection is then closed."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(connect_packet(client_id, clean=False))
        connack = read_exactly(sock, 4)
        with contextlib.suppress(OSError):
            sock.sendall(bytes([0xE0, 0]))  # DISCONNECT: the session stays
        return connack


def test_an_sdk_client_whose_first_address_is_a_backup_moves_on_to_the_primary(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """Clients, SDK: "A failed connection or a CONNACK 3 moves it to the next address"; README: "A backup
    refuses clients with CONNACK 3, so the SDK (`DurableClient(..., failover=[(host, port)])`) ... move[s]
    to the primary"."""
    primary, backup = static_pair(broker_factory)
    client = sdk(backup.port, "sdk-dev", failover=[(HOST, primary.port)])
    got: list[bytes] = []
    arrived = threading.Event()

    def on_event(event: Event) -> None:
        got.append(event.payload)
        arrived.set()

    client.subscribe("t/#", qos=1, listener=on_event)
    client.connect(timeout=WAIT)
    assert client.connected and client.port == primary.port
    client.ready_for_events()
    clients(primary.port, "publisher", clean_session=True).publish("t/a", [b"via the primary"])
    assert arrived.wait(WAIT) and got == [b"via the primary"]


def test_a_promoted_backup_counts_the_replicated_durable_sessions_against_max_durable_sessions(
    broker_factory: Callable[..., Broker],
) -> None:
    """Role changes, "`max_durable_sessions` in a group: a broker counts the durable sessions of its own
    store, so a backup promoted to primary counts those replicated to it, as loaded ... A primary at the
    limit answers a CONNECT that would create a session with CONNACK 3, as a backup does"."""
    limit = {"max_durable_sessions": 2}
    primary = start(node(broker_factory, "p", limit, role="primary"), SERVING)
    backup = start(node(broker_factory, "b", limit, role="backup", primary=address(primary)), BACKUP)
    accepted, unavailable = b"\x20\x02\x00\x00", b"\x20\x02\x00\x03"
    assert [_durable_connack(primary.port, name) for name in ("d1", "d2")] == [accepted, accepted]
    assert _durable_connack(primary.port, "d3") == unavailable  # at the limit: no third session
    head = wait_status(primary, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])["batch"]
    wait_status(backup, lambda s: s["caught_up"] and s["batch"] >= head)

    primary.kill()
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert _durable_connack(backup.port, "d3") == unavailable  # the two replicated sessions count
    assert _durable_connack(backup.port, "d1") == b"\x20\x02\x01\x00"  # an existing one: session present


@pytest.mark.slow
def test_a_killed_backup_drops_out_of_the_members_when_its_entry_expires(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """The most advanced backup takes over: "Every broker writes its position in etcd each `loop_wait`
    ... under a lease of its own that ends `lease_ttl` seconds after its last cycle ... A broker that is
    stopped or cut off from etcd drops out when its entry expires". Bounds: not before what etcd said
    was left of b's member lease just before the SIGKILL (from that question), and within lease_ttl +
    2 loop_wait (the primary's next read) + 4 s after it."""
    first, second = ha_pair(broker_factory, etcd)
    wait_status(first, lambda s: sorted(m["name"] for m in s.get("members", [])) == ["a", "b"])
    asked, left = _lease_left(etcd, "members/b")
    killed = time.monotonic()
    second.kill()
    wait_status(first, lambda s: [m["name"] for m in s.get("members", [])] == ["a"], FAILOVER_WAIT)
    done = time.monotonic()
    ttl, loop_wait = HA_TIMING["lease_ttl"], HA_TIMING["loop_wait"]
    assert done - asked >= left, (done - asked, left)
    assert done - killed <= ttl + 2 * loop_wait + 4.0, done - killed
    assert connack_code(first.port) == SERVING


@pytest.mark.slow
def test_a_node_cut_off_from_its_coordinator_waits_as_a_backup_logging_one_warning_then_one_info(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Coordination: "coordinator unreachable -> "wait""; Logging: "the coordinator not answering, for a
    primary as for a backup, is one WARNING when it starts and one INFO line, "the coordinator answers
    again after N s", when it ends". A new cluster's first node, cut off from etcd from its start, refuses
    clients; once etcd answers, it bootstraps and serves."""
    relay = TcpRelay(HOST, etcd.client_port)
    relay.start()
    try:
        relay.cut()
        alone = start(node(broker_factory, "a", coordinator=[f"http://{relay.address}"], **HA_TIMING), BACKUP)
        silent = "replication HA a: the coordinator does not answer"
        assert alone.wait_until(lambda: silent in alone.log(), FAILOVER_WAIT), alone.log()
        # Several more HA cycles go by silent: each makes new calls, which the blackhole holds (cut()
        # again counts the connections held).
        assert alone.wait_until(lambda: relay.cut() >= 3, FAILOVER_WAIT), alone.log()
        assert connack_code(alone.port) == BACKUP
        relay.heal()
        assert alone.wait_until(lambda: connack_code(alone.port) == SERVING, FAILOVER_WAIT), alone.log()
    finally:
        relay.stop()
    lines = alone.log().splitlines()
    warned = [line for line in lines if silent in line]
    assert len(warned) == 1 and " WARNING " in warned[0], warned
    again = [line for line in lines if "replication HA a: the coordinator answers again after " in line]
    assert len(again) == 1 and " INFO " in again[0], again


@pytest.mark.slow
def test_a_backup_dropped_from_the_synchronous_set_does_not_take_over_when_the_primary_dies(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    """No split brain: "In sync mode the primary also publishes in etcd the backups it waits for; only
    those may be promoted, so a backup dropped for being slow cannot take over without the publishes
    acknowledged after it left"; Limits: "nobody becomes primary: ... the group waits rather than serve a
    store that may lack acknowledged publishes". The backup is paused past ``ack_timeout`` while a publish
    is acknowledged without it; the primary then dies: the backup goes on with its HA cycles (its member
    entry rewritten) with no leader, and never serves."""
    first, second = ha_pair(broker_factory, etcd, ack_timeout=1)
    durable = clients(first.port, "device")
    durable.subscribe("t/#", 1)
    durable.disconnect()
    assert first.wait_until(lambda: in_sync_set(etcd, "b"), WAIT), first.log()
    publisher = clients(first.port, "publisher", clean_session=True)
    with second.paused():
        publisher.publish("t/a", [b"acknowledged without b"])  # after ack_timeout dropped b
        assert first.wait_until(lambda: not in_sync_set(etcd, "b"), WAIT), first.log()
        first.kill()
    assert second.wait_until(lambda: _etcd_key(etcd, "leader") is None, FAILOVER_WAIT), "the lease never ended"
    entry = _etcd_key(etcd, "members/b")
    assert entry is not None
    since = int(entry["version"])  # the key's own count of puts (mod_revision is etcd-wide: any write raises it)

    def cycles_without_a_leader() -> bool:
        current = _etcd_key(etcd, "members/b")
        return current is not None and int(current["version"]) >= since + 3

    assert second.wait_until(cycles_without_a_leader, FAILOVER_WAIT), second.log()  # three more HA cycles
    assert _etcd_key(etcd, "leader") is None and connack_code(second.port) == BACKUP, second.log()


def test_sys_topics_follow_a_backup_that_leaves_and_count_a_refused_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Watching it: "Every `metrics_interval` the primary publishes under `$SYS/broker/durable/replication/`:
    `role`, `mode`, `batch` (the newest batch number), `backups`, `backups_in_sync`, `refused` (connections
    its replication address refused since start, by the handshake, ...)"; "a frame ... that fails its
    checksum closes that connection at once, with a log line naming it, and the node goes on"; `inspect
    --replication`: "`connections refused on its replication address since start: N`, shown once there is
    one"."""
    primary, backup = static_pair(broker_factory, {"metrics_interval": 0.2})
    prefix = "$SYS/broker/durable/replication/"
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe(prefix + "#", 0)

    def latest(key: str) -> bytes | None:
        return next((m.payload for m in reversed(monitor.messages) if m.topic == prefix + key), None)

    assert monitor.wait_for(lambda _: latest("backups_in_sync") == b"1" and latest("refused") == b"0")
    host, port = address(primary).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as stranger:
        stranger.sendall(b"\x01\x00\x00\x00\x04junkjunk")  # a HELLO whose checksum is wrong
        while stranger.recv(4096):  # the node closes it; bounded by the socket's timeout
            pass
    backup.kill()
    assert monitor.wait_for(
        lambda _: (latest("backups"), latest("backups_in_sync"), latest("refused")) == (b"0", b"0", b"1")
    ), [(m.topic, m.payload) for m in monitor.messages[-12:]]
    assert primary.wait_until(lambda: f"{HOST}:" in primary.log() and "checksum" in primary.log(), WAIT), primary.log()

    def batch_published() -> bool:
        current = node_status(primary)  # nothing is published meanwhile: the batch stays
        return current is not None and latest("batch") == str(current["batch"]).encode()

    assert monitor.wait_for(lambda _: batch_published())
    shown = run_cli("inspect", "--replication", address(primary))
    assert "  connections refused on its replication address since start: 1" in shown.stdout.splitlines(), shown
    assert "backup b" not in shown.stdout, shown.stdout  # its row went with its connection


def test_a_sigterm_while_fleet_ha_starts_etcd_leaves_no_etcd_running(tmp_path: Path) -> None:
    """fleet.md: "SIGTERM or Ctrl-C stops the broker and every process it started"; with ``--ha`` "The
    harness starts one etcd member". A SIGTERM that came while that member was getting ready left it
    running, an orphan: its handle was kept only once it was ready, and a SIGTERM during the spawn itself
    unwound from inside ``subprocess.Popen``."""
    signal_fleet_when(tmp_path, ["--ha"], lambda out: bool(processes_in(out / "etcd")), signal.SIGTERM)


@pytest.mark.slow
def test_an_old_async_primary_whose_last_batches_never_reached_the_new_one_rejoins_by_snapshot(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Start a pair: "The old primary comes back as a backup ... It finds the lease taken, follows the new primary
    and is caught up (a snapshot when its last batches never reached the new primary, as after a kill in async
    mode)"; async mode, "Primary SIGKILLed": "the batches the backup had not applied yet are lost"; Protocol:
    otherwise *snapshot*, "with the reason (... history diverged: a former primary whose last batches never
    reached the new one ...)". Here with fixed roles: the old primary is started again as the new one's
    backup; its store ends as the new primary's, without the publishes only it had."""
    primary = start(node(broker_factory, "p", role="primary", mode="async"), SERVING)
    host, port = address(primary).rsplit(":", 1)
    channel = TcpRelay(host, int(port))  # the replication channel, which a cut turns into a blackhole
    channel.start()
    try:
        backup = start(node(broker_factory, "b", role="backup", primary=channel.address), BACKUP)
        wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
        device = clients(primary.port, "device")
        device.subscribe("t/#", 1)
        device.disconnect()
        publisher = clients(primary.port, "publisher", clean_session=True)
        publisher.publish("t/a", [b"on both"])
        head = wait_status(primary, lambda s: [b["lag_batches"] for b in s["backups"]] == [0])["batch"]
        wait_status(backup, lambda s: s["batch"] >= head)
        channel.cut()  # from now on nothing reaches the backup
        publisher.publish("t/a", [b"only on the old primary"])  # async: acknowledged at the local commit
        primary.kill()
    finally:
        channel.stop()
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    clients(backup.port, "publisher-2", clean_session=True).publish("t/a", [b"on the new primary"])

    primary.settings["replication"] = {**primary.settings["replication"], "role": "backup", "primary": address(backup)}
    start(primary, BACKUP)  # the old primary, now the new one's backup
    wait_status(backup, lambda s: [(b["name"], b["state"]) for b in s["backups"]] == [("p", "in_sync")])
    assert "backup p (" in backup.log() and "its history diverged" in backup.log(), backup.log()
    assert "): snapshot at batch " in backup.log(), backup.log()
    head = wait_status(backup, lambda s: s["backups"][0]["lag_batches"] == 0)["batch"]
    wait_status(primary, lambda s: s["caught_up"] and s["batch"] >= head)

    backup.kill()  # the old primary, promoted again, serves what the new one had: not its lost publish
    promoted = run_cli("promote", address(primary))
    assert promoted.returncode == 0, promoted.stderr
    assert primary.wait_until(lambda: connack_code(primary.port) == SERVING, WAIT), primary.log()
    again = clients(primary.port, "device")
    assert again.wait_for(lambda got: len(got) >= 2), [m.payload for m in again.messages]
    assert [m.payload for m in again.messages] == [b"on both", b"on the new primary"]


def test_backups_reach_the_leader_at_its_advertised_address(broker_factory: Callable[..., Broker], etcd: Any) -> None:
    """Settings, ``advertise``: "host:port backups use to reach `listen`, if it differs (published in the
    leader key)". The primary's ``advertise`` is a relay to its ``listen``: its backup's channel goes
    through the relay."""
    ha = {"coordinator": [etcd.url], **HA_TIMING}
    first = node(broker_factory, "a", **ha)
    host, port = address(first).rsplit(":", 1)
    relay = TcpRelay(host, int(port))
    relay.start()
    try:
        first.settings["replication"]["advertise"] = relay.address
        start(first, SERVING)
        second = start(node(broker_factory, "b", **ha), BACKUP)
        wait_status(first, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
        assert wait_status(second, lambda s: s["caught_up"])["primary"] == relay.address
        assert relay.cut() >= 1  # the backup's channel is one of the relay's connections
    finally:
        relay.stop()


@pytest.mark.slow
def test_a_clean_stop_of_an_async_primary_names_a_backup_slower_than_ack_timeout(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Role changes, "Clean stop of a primary (SIGTERM ...): ... the broker waits, at most `ack_timeout`,
    until every in-sync backup acknowledged all batches ... In async mode a clean stop therefore loses
    nothing acknowledged (a backup slower than `ack_timeout` is named in a WARNING)"."""
    primary, backup = static_pair(broker_factory, mode="async", ack_timeout=2)
    device = clients(primary.port, "device")
    device.subscribe("t/#", 1)
    device.disconnect()
    with backup.paused():
        published = time.monotonic()
        clients(primary.port, "publisher", clean_session=True).publish("t/a", [b"acknowledged, not shipped"])
        stopping = time.monotonic()
        primary.terminate()
        assert primary.wait_stopped(time.monotonic() + FAILOVER_WAIT), primary.log()
    stopped = time.monotonic()
    # Whichever names b first: the stop's own wait running out ("stopping with backup(s) b short of
    # batch N"), or, if the stop began late, the ACK watchdog dropping b during that wait ("backup b
    # (...): no ack for 2 s"); both only ack_timeout after the publish.
    names_b = (("backup(s) b short of batch ",), ("replication: backup b (", "): no ack for 2 s: disconnected"))
    warned = [
        line for line in primary.log().splitlines()
        if " WARNING " in line and any(all(part in line for part in parts) for parts in names_b)
    ]  # fmt: skip
    assert warned, primary.log()
    assert stopped - published >= 2.0, stopped - published  # it waited ack_timeout for the backup ...
    assert stopped - stopping < 2.0 + WAIT, stopped - stopping  # ... not for ever
