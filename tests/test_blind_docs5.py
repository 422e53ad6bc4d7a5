"""Black-box tests written from docs/configuration.md, sdk.md, replication.md and guarantees.md alone,
the passages changed last (the digit limit in settings given in Python, the SDK's cut-short values,
what a primary answers a stranger's frames, a backup's queue in its status, an authentication plugin
that raises). Each quotes its promise."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from raw_mqtt_helpers import read_exactly
from test_blind_core import read_all
from test_ha_brokers import BACKUP, SERVING, address, node, start, wait_status

from amqtt_durable import ConfigError, DurableConfig
from amqtt_durable.config import ReplicationConfig, StreamConfig
from amqtt_durable.replication.framing import Frame, Hello, encode_frame, encode_seq
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, run_cli
from durable_client import DurableClient

pytestmark = pytest.mark.timeout(120)

BIG = 10**4301
"""An integer of 4302 digits: past the limit of 4300."""
PRIMARY = {"listen": "127.0.0.1:7883", "role": "primary"}


def refused(make: Callable[..., object], *args: Any) -> str:
    """The ConfigError ``make(*args)`` raises (any other exception fails the test): its message."""
    with pytest.raises(ConfigError) as caught:
        make(*args)
    return str(caught.value)


# ------------------------------------------------------------------ configuration.md: settings in Python


@pytest.mark.parametrize(
    ("settings", "where"),
    [
        ({"max_keepalive": BIG}, "max_keepalive"),
        ({"streams": [{"filter": "a/#", "max_count": BIG}]}, "streams[0].max_count"),
        ({"replication": {**PRIMARY, "ack_timeout": BIG}}, "replication.ack_timeout"),
        ({"session_expiry": -BIG}, "session_expiry"),
    ],
)
def test_an_integer_past_4300_digits_given_in_python_is_refused_naming_where(
    settings: dict[str, Any], where: str
) -> None:
    """configuration.md: "An integer of more than 4300 digits ..., anywhere in the plugin's settings, is
    refused with `'max_keepalive': an integer of more than 4300 digits`, naming where it is written
    (`'streams[0].max_count'`, `'replication.ack_timeout'`): so it is too when the settings are given in
    Python (a mapping to `DurableConfig.from_mapping` ...), where it raises that `ConfigError`"."""
    assert refused(lambda: DurableConfig.from_mapping(settings)).endswith(
        f"'{where}': an integer of more than 4300 digits"
    )


def test_settings_objects_made_directly_refuse_an_integer_past_4300_digits() -> None:
    """configuration.md: so it is too for "`DurableConfig(...)` and `ReplicationConfig(...)` themselves; a
    `StreamConfig(...)` is checked when given in `DurableConfig(streams=[...])`", "where it raises that
    `ConfigError`"."""
    message = "an integer of more than 4300 digits"
    assert refused(lambda: DurableConfig(max_keepalive=BIG)).endswith(f"'max_keepalive': {message}")
    assert refused(lambda: ReplicationConfig(role="primary", listen="127.0.0.1:7883", ack_timeout=BIG)).endswith(
        f"'replication.ack_timeout': {message}"
    )
    assert refused(lambda: DurableConfig(streams=[StreamConfig("a/#", max_count=BIG)])).endswith(
        f"'streams[0].max_count': {message}"
    )


@pytest.mark.parametrize(
    ("settings", "mapping"),
    [
        ({BIG: 1}, "amqtt_durable.DurableSessionsPlugin"),
        ({"replication": {**PRIMARY, BIG: 1}}, "replication"),
        ({"streams": [{"filter": "a/#", BIG: 1}]}, "streams[0]"),
    ],
)
def test_an_integer_past_4300_digits_as_a_key_is_refused_naming_its_mapping(
    settings: dict[Any, Any], mapping: str
) -> None:
    """configuration.md: "such an integer as a key of a mapping given in Python is refused with `a key
    that is an integer of more than 4300 digits`, naming the mapping (`'replication'`, `'streams[0]'`,
    `'amqtt_durable.DurableSessionsPlugin'` for the plugin's own)"."""
    assert refused(lambda: DurableConfig.from_mapping(settings)).endswith(
        f"'{mapping}': a key that is an integer of more than 4300 digits"
    )


@pytest.mark.parametrize(
    ("settings", "where"),
    [
        ({"max_depth": 5.0}, "max_depth"),
        ({"streams": [{"filter": "a/#", "max_count": 5.0}]}, "streams[0].max_count"),
        ({"replication": {**PRIMARY, "lease_ttl": 5.0}}, "replication.lease_ttl"),
        ({"replication": {**PRIMARY, "max_backups": 5.0}}, "replication.max_backups"),
        ({"replication": {**PRIMARY, "retained_batches": 5.0}}, "replication.retained_batches"),
        ({"replication": {**PRIMARY, "retained_bytes": 5.0}}, "replication.retained_bytes"),
        ({"replication": {**PRIMARY, "snapshot_chunk_bytes": 5.0}}, "replication.snapshot_chunk_bytes"),
    ],
)
def test_a_whole_float_for_a_whole_number_setting_says_how_to_write_it(settings: dict[str, Any], where: str) -> None:
    """configuration.md: a whole-number setting (also `streams[].max_count`, and `lease_ttl`,
    `retained_batches`, `retained_bytes`, `max_backups` and `snapshot_chunk_bytes` of `replication`)
    "must be written as a YAML integer: `5.0` ... refused even though it is whole, with `'max_depth': must
    be written as an integer (5), not 5.0` (`'replication.lease_ttl': ...` for replication's)"."""
    assert refused(lambda: DurableConfig.from_mapping(settings)).endswith(
        f"'{where}': must be written as an integer (5), not 5.0"
    )


@pytest.mark.parametrize(("value", "shown"), [(5.5, "5.5"), ("5", "'5'"), (True, "True")])
def test_a_fraction_a_string_or_a_bool_for_a_whole_number_is_not_a_whole_number(value: object, shown: str) -> None:
    """configuration.md: "`5.5`, `"5"` or `true` are refused with `'max_depth': expected a whole number,
    got 5.5`"; "A setting the table gives as a *number* takes `5` and `5.0` alike"."""
    assert refused(lambda: DurableConfig.from_mapping({"max_depth": value})).endswith(
        f"'max_depth': expected a whole number, got {shown}"
    )
    assert DurableConfig.from_mapping({"session_expiry": 5}).session_expiry == 5
    assert DurableConfig.from_mapping({"session_expiry": 5.0}).session_expiry == 5


def test_a_number_setting_given_a_fraction_of_huge_integers_is_a_config_error() -> None:
    """configuration.md: "a `Fraction` given in Python whose numerator or denominator is such an integer
    is refused with `'session_expiry': a fraction of an integer of more than 4300 digits`" (it raised
    Python's own ValueError from the Fraction's repr, or an OverflowError made directly)."""
    message = "a fraction of an integer of more than 4300 digits"
    for settings, where in [
        ({"session_expiry": Fraction(BIG, 3)}, "session_expiry"),
        ({"replication": {**PRIMARY, "ack_timeout": Fraction(3, BIG)}}, "replication.ack_timeout"),
        ({"streams": [{"filter": "a/#", "max_age": Fraction(BIG, 7)}]}, "streams[0].max_age"),
    ]:
        assert refused(DurableConfig.from_mapping, settings).endswith(f"'{where}': {message}")
    assert refused(lambda: DurableConfig(session_expiry=Fraction(BIG, 3))).endswith(f"'session_expiry': {message}")


@pytest.mark.parametrize(("interpreter", "limit"), [(640, 640), (0, 4300)])
def test_settings_in_python_count_to_the_interpreter_s_lower_limit_and_4300_otherwise(
    interpreter: int, limit: int
) -> None:
    """configuration.md: "An integer of more than 4300 digits (or the interpreter's lower limit, where
    `PYTHONINTMAXSTRDIGITS` sets one), anywhere in the plugin's settings, is refused" (sys.set_int_max_str_digits
    sets the same limit); with Python's own limit off (0) the 4300 holds."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(interpreter)
    try:
        past = 10**limit  # limit + 1 digits
        for settings, where, what in [
            ({"max_keepalive": past}, "max_keepalive", "an integer"),
            ({"replication": {**PRIMARY, "lease_ttl": past}}, "replication.lease_ttl", "an integer"),
            ({past: 1}, "amqtt_durable.DurableSessionsPlugin", "a key that is an integer"),
            ({"session_expiry": Fraction(past, 3)}, "session_expiry", "a fraction of an integer"),
        ]:
            assert refused(DurableConfig.from_mapping, settings).endswith(
                f"'{where}': {what} of more than {limit} digits"
            )
        assert "digits" not in refused(DurableConfig.from_mapping, {"max_keepalive": past // 10})  # at the limit
    finally:
        sys.set_int_max_str_digits(before)


def test_max_backups_defaults_to_8_and_must_be_at_least_1() -> None:
    """replication.md, settings: "`max_backups` | `8` | whole number ... at least 1"."""
    assert ReplicationConfig.from_mapping(dict(PRIMARY), "replication").max_backups == 8
    assert refused(lambda: ReplicationConfig.from_mapping({**PRIMARY, "max_backups": 0}, "replication")).startswith(
        "amqtt_durable config: 'replication.max_backups'"
    )
    assert ReplicationConfig.from_mapping({**PRIMARY, "max_backups": 1}, "replication").max_backups == 1


def test_catch_up_timeout_defaults_to_60_and_must_be_above_0() -> None:
    """configuration.md / replication.md: `catch_up_timeout` ... "default 60", "above 0"."""
    assert ReplicationConfig.from_mapping(dict(PRIMARY), "replication").catch_up_timeout == 60
    for bad in (0, -1, float("inf"), float("nan")):
        message = refused(ReplicationConfig.from_mapping, {**PRIMARY, "catch_up_timeout": bad}, "replication")
        assert "'replication.catch_up_timeout'" in message, message
    assert ReplicationConfig.from_mapping({**PRIMARY, "catch_up_timeout": 0.001}, "replication").catch_up_timeout > 0


# ------------------------------------------------------------------ sdk.md: a long value shown cut short


def test_a_long_integer_or_fraction_is_shown_as_its_size_in_bits() -> None:
    """sdk.md, Bad input: "a long value is shown cut short (an integer past 4300 digits, as its size in
    bits, `an integer of 14288 bits` for `10**4301`; a fraction with such a numerator or denominator as
    both sizes, `a fraction of 14288/2 bits` for `Fraction(10**4301, 3)`"; the message starts with the
    option's name; a wrong type raises `WrongTypeError`, both a ValueError and a TypeError."""
    with pytest.raises(ValueError, match=r"^port .*got an integer of 14288 bits$"):
        DurableClient("d5-port", port=BIG)
    with pytest.raises(ValueError, match=r"^session_expiry .*got a fraction of 14288/2 bits$"):
        DurableClient("d5-expiry", session_expiry=Fraction(BIG, 3))
    with pytest.raises(ValueError, match=r"^reconnect_max_delay .*a fraction of 2/14288 bits$"):
        DurableClient("d5-delay", reconnect_max_delay=Fraction(3, BIG))


def test_under_a_lower_interpreter_limit_the_sdk_counts_to_that_one() -> None:
    """sdk.md: "the SDK counts them itself, and where `sys.set_int_max_str_digits()` sets a lower limit
    it counts to that one": an integer of 641 digits under a limit of 640 is shown as its bits."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        with pytest.raises(ValueError, match=r"^port .*got an integer of 2127 bits$"):
            DurableClient("d5-640", port=10**640)
    finally:
        sys.set_int_max_str_digits(before)


# ------------------------------------------------------------------ replication.md: a primary's strangers


def replication_socket(broker: Broker) -> socket.socket:
    host, port = address(broker).rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT)


def refused_count(broker: Broker) -> int:
    return int(wait_status(broker, lambda s: True)["refused"])


@pytest.fixture
def pair(broker_factory: Callable[..., Broker]) -> Iterator[tuple[Broker, Broker]]:
    """A primary (fixed role) and a real backup of it, in sync."""
    primary = start(node(broker_factory, "p5", role="primary"), SERVING)
    backup = start(node(broker_factory, "b5", role="backup", primary=address(primary)), BACKUP)
    wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
    yield primary, backup
    backup.stop()


def logged_after(broker: Broker, start: int, pattern: str) -> str:
    """The first line of ``broker``'s log past character ``start`` matching ``pattern`` (waited for)."""
    found: list[str] = []

    def seen() -> bool:
        found[:] = [line for line in broker.log()[start:].splitlines() if re.search(pattern, line)]
        return bool(found)

    assert broker.wait_until(seen, WAIT), f"no line matching {pattern!r}:\n{broker.log()[start:]}"
    return found[0]


@pytest.mark.slow
def test_a_first_frame_that_is_no_hello_is_refused_unanswered_and_counted(pair: tuple[Broker, Broker]) -> None:
    """replication.md, Limitations: "So does a first frame of no known type, or one that is neither a
    HELLO nor a tool's question (a frame the primary sends, an ACK: a WARNING, `refused a connection from
    ADDRESS:PORT: a HELLO does not decode (first frame is BATCH)`, rate-limited and counted in `refused`
    as the handshake's refusals); nothing is answered to these"; the backups served are not disturbed."""
    primary, _ = pair
    for kind in (Frame.BATCH, Frame.ACK):
        before, mark = refused_count(primary), len(primary.log())
        with replication_socket(primary) as sock:
            local = sock.getsockname()[1]
            sock.sendall(encode_frame(kind, encode_seq(1)))
            assert read_all(sock) == b"", "a frame that is no HELLO was answered"
        line = logged_after(primary, mark, rf"first frame is {kind.name}")
        assert " WARNING " in line, line
        assert line.endswith(
            f"refused a connection from 127.0.0.1:{local}: a HELLO does not decode (first frame is {kind.name})"
        ), line
        wait_status(primary, lambda s, n=before: s["refused"] == n + 1)
    assert [row["state"] for row in wait_status(primary, lambda s: True)["backups"]] == ["in_sync"]


@pytest.mark.slow
def test_a_hello_of_another_version_gets_an_error_frame_naming_both_and_is_counted(pair: tuple[Broker, Broker]) -> None:
    """replication.md, Protocol: "The primary reads the HELLO's protocol version ... one other than 1 is
    answered with an ERROR frame, `replication protocol version N not supported: this primary speaks 1`,
    and the connection is closed; the refusal is logged and counted as the handshake's are (a WARNING,
    `refused a connection from ADDRESS:PORT: replication protocol version N not supported: this primary
    speaks 1`, rate-limited, counted in `refused`), and such a backup is never served"."""
    primary, _ = pair
    before, mark = refused_count(primary), len(primary.log())
    text = "replication protocol version 2 not supported: this primary speaks 1"
    with replication_socket(primary) as sock:
        local = sock.getsockname()[1]
        sock.sendall(encode_frame(Frame.HELLO, Hello(0, 0, 0, "newer", version=2).encode()))
        assert read_all(sock) == encode_frame(Frame.ERROR, text.encode())
    line = logged_after(primary, mark, re.escape(text))
    assert " WARNING " in line and line.endswith(f"refused a connection from 127.0.0.1:{local}: {text}"), line
    shown = wait_status(primary, lambda s: s["refused"] == before + 1)
    assert [row["name"] for row in shown["backups"]] == ["b5"], "a backup of another version was served"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zq/a", "zq+b", "zq#c", "zq\td", "zq" + "e" * 1023])
def test_a_hello_whose_name_is_no_replication_name_is_refused_and_the_name_never_logged(
    broker_factory: Callable[..., Broker], name: str
) -> None:
    """replication.md, Protocol: "A HELLO whose name is empty, holds `/`, `+`, `#` or a control
    character, or is longer than 1024 bytes of UTF-8 ... does not decode: its connection is refused as
    the handshake refuses one (a WARNING, `refused a connection from ADDRESS:PORT: a HELLO does not
    decode (...)`, rate-limited and counted in `refused` ...), and the name never reaches the `$SYS`
    topics or the logs"."""
    primary = start(node(broker_factory, "p5n", role="primary"), SERVING)
    before, mark = refused_count(primary), len(primary.log())
    with replication_socket(primary) as sock:
        local = sock.getsockname()[1]
        hello = Hello(0, 0, 0, "placeholder").encode().replace(b"placeholder", name.encode())  # no name check here
        sock.sendall(encode_frame(Frame.HELLO, hello))
        read_all(sock)
    line = logged_after(primary, mark, rf"refused a connection from 127\.0\.0\.1:{local}: a HELLO does not decode \(")
    assert " WARNING " in line, line
    wait_status(primary, lambda s: s["refused"] == before + 1)
    assert name not in primary.log()[mark:], "the refused name reached the log"
    assert wait_status(primary, lambda s: True)["backups"] == []


@pytest.mark.slow
def test_a_backup_connection_sending_another_frame_than_an_ack_is_disconnected_naming_it(
    pair: tuple[Broker, Broker],
) -> None:
    """replication.md, Limitations: "So does, on a backup's connection to the primary, any frame after the
    HELLO but an ACK, and an ACK of a batch the backup was not sent ...: `backup NAME (ADDRESS:PORT):
    disconnected (FrameError: ...)`, a WARNING naming the frame"; the real backup stays in sync."""
    primary, _ = pair
    for name, frame in [("odd", encode_frame(Frame.STATUS)), ("ahead", encode_frame(Frame.ACK, encode_seq(10**9)))]:
        mark = len(primary.log())
        with replication_socket(primary) as sock:
            local = sock.getsockname()[1]
            sock.sendall(encode_frame(Frame.HELLO, Hello(0, 0, 0, name, instance=5).encode()))
            wait_status(primary, lambda s, n=name: n in [row["name"] for row in s["backups"]])
            sock.sendall(frame)
            line = logged_after(primary, mark, rf"backup {name} \(127\.0\.0\.1:{local}\): disconnected \(FrameError: ")
            assert " WARNING " in line, line
            read_all(sock)
        wait_status(primary, lambda s: [row["name"] for row in s["backups"]] == ["b5"])
    assert [row["state"] for row in wait_status(primary, lambda s: True)["backups"]] == ["in_sync"]


@pytest.mark.slow
def test_an_in_sync_backup_shows_an_empty_queue_and_inspect_leaves_it_out(pair: tuple[Broker, Broker]) -> None:
    """replication.md: "A backup's status also says ... `queued_bytes` (... 0 between connections) and
    `queue_full` (`true` while it stops reading ...). `inspect --replication` adds them to its
    `following` line while they are not 0 or false"; a fresh backup, before any connection, is 0 too."""
    primary, backup = pair
    shown = wait_status(backup, lambda s: s.get("caught_up") is True and s.get("queued_bytes") == 0)
    assert shown["queue_full"] is False
    text = run_cli("inspect", "--replication", address(backup)).stdout
    [following] = [line for line in text.splitlines() if line.strip().startswith("following")]
    assert following.strip() == f"following {address(primary)}: in_sync, caught up", text
    as_json = run_cli("inspect", "--replication", address(backup), "--json")
    assert '"queued_bytes": 0' in as_json.stdout and '"queue_full": false' in as_json.stdout, as_json.stdout


# ------------------------------------------------------------------ guarantees.md: authentication plugins


AUTH = '''
from amqtt.plugins.base import BaseAuthPlugin


class Gate(BaseAuthPlugin):
    """Password "down" stands for a service that cannot be reached, "no" for refused credentials."""

    async def authenticate(self, *, session):
        if session.password == "down":
            raise ConnectionRefusedError("the user service at 10.9.9.9 cannot be reached")
        return session.password != "no"
'''


@pytest.mark.slow
def test_an_auth_plugin_that_raises_gets_connack_3_and_one_that_refuses_connack_5_leaving_the_session(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """guarantees.md: "a CONNECT whose credentials cannot be checked (an authentication plugin raises an
    error ...) gets CONNACK 3 (server unavailable; the error logged as an ERROR naming it, with its
    traceback) and its connection is closed (for plugin authors: to refuse, an authentication plugin
    returns False (CONNACK 5) ...)", "a CONNECT that fails authentication gets CONNACK 5 (session present
    0) before amqtt touches the session of its client id"."""
    (tmp_path / "gate_auth.py").write_text(AUTH)
    broker = broker_factory(start=False)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["gate_auth.Gate"] = {}
    broker.start()
    device = Client(broker.port, "d5-device", username="dev")
    device.subscribe("d5/#", 1)
    device.disconnect()
    publisher = Client(broker.port, "d5-pub", clean_session=True)
    publisher.publish("d5/t", [b"queued"], qos=1)
    for password, code in (("down", 3), ("no", 5)):
        # CONNECT of the session's owner, "dev", with this password, clean session 0, keepalive 60
        body = mqtt_string("MQTT") + bytes((4, 0xC0)) + (60).to_bytes(2, "big") + mqtt_string("d5-device")
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(mqtt_packet(0x10, body + mqtt_string("dev") + mqtt_string(password)))
            assert read_exactly(sock, 4) == bytes([0x20, 2, 0, code]), password
            assert read_all(sock) == b"", f"{password}: not closed after its CONNACK"
    log = broker.log()
    [error] = [line for line in log.splitlines() if "cannot be reached" in line and " ERROR " in line]
    assert "ConnectionRefusedError" in log[log.index(error) :] and "Traceback" in log[log.index(error) :], log
    again = Client(broker.port, "d5-device", username="dev")
    assert again.session_present, "a refused CONNECT touched the session"
    assert again.wait_for(lambda ms: [m.payload for m in ms] == [b"queued"]), "the queue was lost"
    publisher.disconnect()
    again.disconnect()


# ------------------------------------------------------------------ replication.md: how many backups, strangers


def fake_backup(primary: Broker, name: str, instance: int, receive_buffer: int | None = None) -> socket.socket:
    """A connection to the primary's replication address that says HELLO as backup ``name`` from an
    empty store, then reads nothing unless told to."""
    host, port = address(primary).rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before the connect: the window the primary may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(WAIT)
    sock.connect((host, int(port)))
    sock.sendall(encode_frame(Frame.HELLO, Hello(0, 0, 0, name, instance=instance).encode()))
    return sock


@pytest.mark.slow
def test_by_default_8_backups_are_served_a_ninth_is_refused_and_a_freed_place_is_taken(
    broker_factory: Callable[..., Broker],
) -> None:
    """replication.md, How many backups: "A primary serves at most `max_backups` backup connections at
    once (default 8 ...)"; "One HELLO more is answered with an ERROR frame, `too many backups:
    max_backups is N (backup NAME refused; it retries)`, and the connection is closed before the backup
    is given anything"; "A tool's STATUS or PROMOTE takes no place either"; "A place frees as soon as a
    served backup's connection ends"."""
    primary = start(node(broker_factory, "p5c", role="primary"), SERVING)
    served = [fake_backup(primary, f"f{n}", instance=100 + n) for n in range(8)]
    try:
        for sock in served:
            assert sock.recv(1) == bytes([Frame.SNAP_BEGIN]), "one of the first 8 was not served"
        shown = wait_status(primary, lambda s: len(s["backups"]) == 8)  # a tool's STATUS, answered while full
        assert sorted(row["name"] for row in shown["backups"]) == [f"f{n}" for n in range(8)]
        promoted = run_cli("promote", address(primary))  # a tool's PROMOTE: answered (refused: the primary already)
        assert promoted.returncode == 1 and "it is the primary already" in promoted.stdout + promoted.stderr, promoted
        assert "too many backups" not in promoted.stdout + promoted.stderr, promoted
        text = "too many backups: max_backups is 8 (backup f8 refused; it retries)"
        with fake_backup(primary, "f8", instance=108) as ninth:
            assert read_all(ninth) == encode_frame(Frame.ERROR, text.encode())
        served.pop(0).close()
        wait_status(primary, lambda s: len(s["backups"]) == 7)
        with fake_backup(primary, "f8", instance=108) as ninth:
            assert ninth.recv(1) == bytes([Frame.SNAP_BEGIN]), "the freed place was not taken"
            wait_status(primary, lambda s: "f8" in [row["name"] for row in s["backups"]])
    finally:
        for sock in served:
            sock.close()


@pytest.mark.slow
def test_a_backup_that_reads_nothing_of_its_snapshot_is_cut_at_catch_up_timeout(
    broker_factory: Callable[..., Broker],
) -> None:
    """replication.md, A backup that reads nothing: "After `catch_up_timeout` seconds with no byte taken
    it aborts the connection and logs a WARNING: `replication: backup thief (10.0.0.9:51234):
    disconnected: its connection took no byte for 60 s during its snapshot, 3104 rows sent; what was
    held for it (a snapshot, retained batches) is released (a real backup on a link this slow: raise
    replication.catch_up_timeout)`"; "its row is gone from `inspect --replication`"."""
    primary = start(node(broker_factory, "p5t", role="primary", catch_up_timeout=1), SERVING)
    device = Client(primary.port, "d5-big")
    device.subscribe("big/#", 1)
    device.disconnect()
    publisher = Client(primary.port, "d5-big-pub", clean_session=True)
    publisher.publish("big/t", [bytes([n]) * 65536 for n in range(200)], qos=1)  # 13 MB to copy
    publisher.disconnect()
    mark = len(primary.log())
    with fake_backup(primary, "thief", instance=77, receive_buffer=4096) as thief:
        local = thief.getsockname()[1]
        line = logged_after(primary, mark, rf"backup thief \(127\.0\.0\.1:{local}\): disconnected: ")
        assert " WARNING " in line, line
        assert re.search(
            rf"replication: backup thief \(127\.0\.0\.1:{local}\): disconnected: its connection took no byte for 1 s "
            r"during its snapshot, \d+ rows sent; what was held for it \(a snapshot, retained batches\) is released "
            r"\(a real backup on a link this slow: raise replication\.catch_up_timeout\)$",
            line,
        ), line
        wait_status(primary, lambda s: s["backups"] == [])
        assert "thief" not in run_cli("inspect", "--replication", address(primary)).stdout


@pytest.mark.slow
def test_a_backup_pointed_at_a_backup_is_refused_naming_what_it_follows_and_says_so(
    pair: tuple[Broker, Broker], broker_factory: Callable[..., Broker]
) -> None:
    """replication.md, A backup pointed at a backup: "A backup's replication address answers a backup's
    HELLO with an ERROR frame, `not the primary: backup NAME (follows HOST:PORT); replication.primary must
    name the primary's address` ..., and closes the connection"; the backup pointed at it "logs a WARNING,
    `replication: backup NAME: channel to HOST:PORT refused (retried every 0.5 s, this line at most once
    a minute): REASON`", "`inspect --replication` on it shows `disconnected, not caught up` and the reason
    on a line of its own (`refused_by_primary` in `--json`)"."""
    primary, backup = pair
    reason = (
        f"not the primary: backup b5 (follows {address(primary)}); replication.primary must name the primary's address"
    )
    with fake_backup(backup, "lost", instance=9) as sock:
        assert read_all(sock) == encode_frame(Frame.ERROR, reason.encode())
    lost = start(node(broker_factory, "lost5", role="backup", primary=address(backup)), BACKUP)
    said = (
        f"replication: backup lost5: channel to {address(backup)} refused (retried every 0.5 s, this line at most "
        f"once a minute): {reason}"
    )
    assert lost.wait_until(lambda: said in lost.log(), WAIT), lost.log()
    assert [" WARNING " in line for line in lost.log().splitlines() if said in line] == [True]
    shown = wait_status(lost, lambda s: s.get("refused_by_primary") == reason)
    assert shown["caught_up"] is False
    text = run_cli("inspect", "--replication", address(lost)).stdout
    lines = [line.strip() for line in text.splitlines()]
    following = lines.index(f"following {address(backup)}: disconnected, not caught up")
    assert reason in lines[following + 1 :], text
    lost.stop()


# ------------------------------------------------------------------ sdk.md: a refused subscription


@pytest.mark.slow
def test_a_refused_subscription_is_sent_again_at_the_reconnect_and_logged_once_granted(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md: "A SUBACK that refuses the filter (0x80: the topic ACL, `max_subscriptions_per_client`)
    does not raise: it is logged as a WARNING, the subscription stays registered and is sent again after
    every reconnect ...: refused again, with the same WARNING, or granted. It writes no delivery-log
    record until a SUBACK grants it"; the broker routes nothing to it meanwhile."""
    broker = broker_factory(max_subscriptions_per_client=1)
    log_path = tmp_path / "d5-deliveries.jsonl"
    connected = threading.Semaphore(0)
    got: list[bytes] = []
    arrived = threading.Event()
    client = sdk(broker.port, "d5-refused", delivery_log=str(log_path), on_connected=lambda _info: connected.release())
    client.connect()
    assert connected.acquire(timeout=WAIT)
    client.subscribe("r5/a", qos=1)
    with caplog.at_level("WARNING", logger="durable_client"):
        client.subscribe(
            "r5/b", qos=1, listener=lambda e: (got.append(e.payload), e.payload == b"after" and arrived.set())
        )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "r5/b" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    client.ready_for_events()

    def subscribed() -> list[str]:
        return [json.loads(line)["topic"] for line in log_path.read_text().splitlines() if '"subscribe"' in line]

    assert subscribed() == ["r5/a"], "a refused filter got a delivery-log record"
    clients(broker.port, "d5-refused-pub", clean_session=True).publish("r5/b", [b"before"], qos=1)
    client.unsubscribe("r5/a")  # the place the refused filter needs at the reconnect
    broker.restart()
    assert connected.acquire(timeout=WAIT), "no reconnect"
    assert broker.wait_until(lambda: subscribed() == ["r5/a", "r5/b"], WAIT), subscribed()
    clients(broker.port, "d5-refused-pub2", clean_session=True).publish("r5/b", [b"after"], qos=1)
    assert arrived.wait(WAIT), got
    assert got == [b"after"], "the broker routed to a refused filter"


@pytest.mark.slow
def test_the_sys_refused_count_takes_version_and_max_backups_refusals(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """replication.md: "Every `metrics_interval` the primary publishes under `$SYS/broker/durable/replication/`:
    ... `refused` (connections its replication address refused since start, by the handshake, closed at
    once, not in `allow_from`, of an unknown protocol version or past `max_backups` ...)"; Securing the
    replication channel: it "is `refused` in STATUS (`inspect --replication`: `connections refused on its
    replication address since start: N`, shown once there is one)"."""
    primary = start(node(broker_factory, "p5s", {"metrics_interval": 0.2}, role="primary", max_backups=1), SERVING)
    watcher = clients(primary.port, "d5-sys", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/replication/refused", 0)
    assert watcher.wait_for(lambda ms: any(m.payload == b"0" for m in ms)), "no refused count of 0 at start"
    with fake_backup(primary, "only", instance=1) as served:
        assert served.recv(1) == bytes([Frame.SNAP_BEGIN])
        with fake_backup(primary, "past", instance=2) as past:
            assert read_all(past)[0] == Frame.ERROR, "not refused past max_backups"
        with replication_socket(primary) as newer:
            newer.sendall(encode_frame(Frame.HELLO, Hello(0, 0, 0, "newer", version=3).encode()))
            assert read_all(newer)[0] == Frame.ERROR, "not refused for its version"
        assert watcher.wait_for(lambda ms: ms[-1].payload == b"2"), [m.payload for m in watcher.messages[-3:]]
    shown = run_cli("inspect", "--replication", address(primary)).stdout
    assert "connections refused on its replication address since start: 2" in shown, shown


@pytest.mark.slow
def test_a_name_held_by_another_process_s_backup_is_refused_with_the_documented_texts(
    pair: tuple[Broker, Broker],
) -> None:
    """replication.md, One name, one backup: "the primary answers its HELLO with an ERROR frame, `backup name
    b is in use by the backup connected from HOST:PORT (this connection: HOST:PORT); give each backup its
    own replication.name`, and closes the connection. The connected backup is not disturbed ... The primary
    logs an ERROR, `refused backup name b from HOST:PORT: the name b is in use by the backup connected from
    HOST:PORT, another broker process; ...`"."""
    primary, _ = pair
    mark = len(primary.log())
    with fake_backup(primary, "b5", instance=4242) as clash:
        local = clash.getsockname()[1]
        answer = read_all(clash)
    text = (
        rf"backup name b5 is in use by the backup connected from 127\.0\.0\.1:(\d+) "
        rf"\(this connection: 127\.0\.0\.1:{local}\); give each backup its own replication\.name"
    )
    found = re.fullmatch(text.encode(), answer[5:-4])  # an ERROR frame: type, length, text, checksum
    assert answer[0] == Frame.ERROR and found, answer
    held_by = found.group(1).decode()
    line = logged_after(primary, mark, rf"refused backup name b5 from 127\.0\.0\.1:{local}: ")
    assert " ERROR " in line, line
    assert (
        f"refused backup name b5 from 127.0.0.1:{local}: the name b5 is in use by the backup connected from "
        f"127.0.0.1:{held_by}, another broker process; "
    ) in line, line
    shown = wait_status(primary, lambda s: True)
    assert [(row["name"], row["state"]) for row in shown["backups"]] == [("b5", "in_sync")]


# ------------------------------------------------------------------ configuration.md: max_awaiting_pubrel


def qos2_publish(packet_id: int, dup: bool = False) -> bytes:
    """A QoS 2 PUBLISH to p5/q of packet id ``packet_id``."""
    return mqtt_packet(0x34 | (0x08 if dup else 0), mqtt_string("p5/q") + packet_id.to_bytes(2, "big") + b"x")


@pytest.mark.slow
def test_a_new_qos2_packet_id_past_max_awaiting_pubrel_closes_the_connection_and_a_pubrel_frees_a_place(
    broker_factory: Callable[..., Broker],
) -> None:
    """configuration.md, `max_awaiting_pubrel`: "A QoS 2 PUBLISH with a new packet id while that many await
    closes the connection, unacknowledged, with a WARNING naming the client and the limit ... A re-send of
    one that awaits ... counts once, and its PUBREL frees its place"."""
    broker = broker_factory(max_awaiting_pubrel=2)
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(
            mqtt_packet(0x10, mqtt_string("MQTT") + bytes((4, 2)) + (60).to_bytes(2, "big") + mqtt_string("d5-q2"))
        )
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
        for packet_id in (1, 2):
            sock.sendall(qos2_publish(packet_id))
            assert read_exactly(sock, 4) == b"\x50\x02" + packet_id.to_bytes(2, "big"), "no PUBREC"
        sock.sendall(qos2_publish(2, dup=True))  # a re-send of one that awaits: counts once
        assert read_exactly(sock, 4) == b"\x50\x02\x00\x02", "a re-send was not answered"
        sock.sendall(mqtt_packet(0x62, (1).to_bytes(2, "big")))  # PUBREL 1 frees its place
        assert read_exactly(sock, 4) == b"\x70\x02\x00\x01", "no PUBCOMP"
        sock.sendall(qos2_publish(3))
        assert read_exactly(sock, 4) == b"\x50\x02\x00\x03", "the place PUBREL 1 freed was not given"
        mark = len(broker.log())
        sock.sendall(qos2_publish(4))  # 2 and 3 await: a new id closes the connection, unacknowledged
        assert read_all(sock) == b"", "the publish past the limit was answered"
    line = logged_after(broker, mark, r"d5-q2")
    assert " WARNING " in line and "max_awaiting_pubrel" in line and " 2" in line, line


@pytest.mark.slow
def test_a_peer_that_closes_before_its_first_frame_is_not_refused_nor_counted(pair: tuple[Broker, Broker]) -> None:
    """replication.md, Securing the replication channel: "A silent peer is one still silent at
    `handshake_timeout`; a peer that closes its connection before then is not refused (an INFO line, not
    counted)"."""
    primary, _ = pair
    before, mark = refused_count(primary), len(primary.log())
    with replication_socket(primary) as sock:
        local = sock.getsockname()[1]
    line = logged_after(primary, mark, rf"127\.0\.0\.1:{local}\b")
    assert " INFO " in line, line
    with replication_socket(primary) as sock:  # a counted refusal after it: the count moves by that one only
        sock.sendall(encode_frame(Frame.ACK, encode_seq(1)))
        assert read_all(sock) == b""
    shown = wait_status(primary, lambda s: s["refused"] >= before + 1)
    assert shown["refused"] == before + 1
    assert not [ln for ln in primary.log()[mark:].splitlines() if f":{local}" in ln and " INFO " not in ln]


@pytest.mark.slow
def test_a_backup_whose_primary_stopped_shows_0_queued_bytes_and_no_full_queue(pair: tuple[Broker, Broker]) -> None:
    """replication.md: "`queued_bytes` (the payload bytes of the frames its connection has read that wait
    behind the write under way ...; 0 between connections) and `queue_full`"; inspect adds them to its
    `following` line only "while they are not 0 or false"."""
    primary, backup = pair
    primary.stop()
    shown = wait_status(backup, lambda s: s["state"] != "in_sync")
    assert (shown["queued_bytes"], shown["queue_full"]) == (0, False), shown
    text = run_cli("inspect", "--replication", address(backup)).stdout
    assert "not yet applied" not in text and "queue full" not in text, text


@pytest.mark.slow
def test_a_backup_that_reads_nothing_of_its_catch_up_is_cut_at_catch_up_timeout(
    broker_factory: Callable[..., Broker],
) -> None:
    """replication.md, A backup that reads nothing: the same WARNING, "(`during its catch-up, batch N sent, M
    acknowledged; what was held for it (retained batches)` when it was being sent batches)", and its row
    is gone: a peer saying HELLO from a stopped backup's position, then reading nothing of the 13 MB
    published since, which the retained log holds."""
    import plyvel  # noqa: PLC0415

    from amqtt_durable.replication.position import read_position, read_store_id  # noqa: PLC0415

    primary = start(node(broker_factory, "p5u", role="primary", catch_up_timeout=1), SERVING)
    backup = start(node(broker_factory, "b5u", role="backup", primary=address(primary)), BACKUP)
    wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
    device = Client(primary.port, "d5-catch")
    device.subscribe("big/#", 1)
    device.disconnect()
    backup.stop()
    db = plyvel.DB(backup.store)
    try:
        store_id, position = read_store_id(db), read_position(db)
    finally:
        db.close()
    assert position is not None and position[0] > 0
    wait_status(primary, lambda s: s["backups"] == [])
    publisher = Client(primary.port, "d5-catch-pub", clean_session=True)
    publisher.publish("big/t", [bytes([n]) * 65536 for n in range(200)], qos=1)
    publisher.disconnect()
    mark = len(primary.log())
    host, port = address(primary).rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        thief.settimeout(WAIT)
        thief.connect((host, int(port)))
        thief.sendall(encode_frame(Frame.HELLO, Hello(store_id, *position, "thief2", instance=78).encode()))
        local = thief.getsockname()[1]
        line = logged_after(primary, mark, rf"backup thief2 \(127\.0\.0\.1:{local}\): disconnected: ")
        assert " WARNING " in line, line
        assert re.search(
            rf"replication: backup thief2 \(127\.0\.0\.1:{local}\): disconnected: its connection took no byte for 1 s "
            r"during its catch-up, batch \d+ sent, \d+ acknowledged; what was held for it \(retained batches\) is "
            r"released \(a real backup on a link this slow: raise replication\.catch_up_timeout\)$",
            line,
        ), line
        wait_status(primary, lambda s: s["backups"] == [])
