"""A twelfth pass of black-box tests written from docs/operations.md, docs/configuration.md,
docs/store-layout.md and README.md alone: the exact error texts and exit codes of ``amqtt-durable broker``
for bad ``broker.yaml`` values (floats for whole numbers, integers of too many digits, keys given twice, the
plugin listed twice, amqtt's own refusals), the same rules through ``DurableConfig`` in Python, the defaults,
``inspect``'s and ``repair``'s refusals, table layout and JSON fields, the damage ``inspect`` names, a store
without ``CURRENT``, another program's LevelDB, limits as a client meets them. Real broker processes on
127.0.0.1, real LevelDB, real paho clients; the commands that end without serving run in this process
(run_here); each test quotes the promise it checks. Promises other tests already check are left to them.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import plyvel
import pytest
from small_disk import fill, remount_read_only, small_disk

from amqtt_durable import ConfigError, DurableConfig
from amqtt_durable.cli import load_broker_config
from amqtt_durable.process import HOST, free_port
from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, run_cli
from durable_fleet import console

pytestmark = pytest.mark.timeout(90)

PLUGIN = "amqtt_durable.DurableSessionsPlugin"


def config_text(store: Path, plugin_lines: str = "", port: int | None = None, top: str = "") -> str:
    """A broker.yaml: one TCP listener, anonymous access, the plugin with ``store`` and ``plugin_lines``."""
    port = port or free_port()
    indented = "".join(f"    {line}\n" for line in plugin_lines.splitlines())
    return (
        f"{top}listeners:\n  default:\n    type: tcp\n    bind: {HOST}:{port}\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
        f"  {PLUGIN}:\n    store: {store}\n    metrics_interval: 0\n{indented}"
    )


def run_broker_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """``amqtt-durable broker -c FILE`` on a config that must not start: its exit, output captured."""
    path = tmp_path / "broker.yaml"
    path.write_text(text)
    return run_cli("broker", "-c", str(path))


def run_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``amqtt-durable ARGS`` run in this process, for a command that ends without serving (inspect,
    repair, promote, a usage error, a config ``broker`` refuses): its exit code and output as run_cli
    gives them (the console passes main's return on as the exit code), without an interpreter's start
    for each. Not for output the command logs (a child prints WARNINGs by logging's last resort)."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = console.main(list(args))
            except SystemExit as exc:  # argparse's usage error
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["amqtt-durable", *args], code, out.getvalue(), err.getvalue())


def refused_here(tmp_path: Path, text: str | None) -> subprocess.CompletedProcess[str]:
    """``amqtt-durable broker -c FILE`` on a config (None: no file) it refuses before anything starts
    (checked first, so a config taken by mistake fails here instead of serving in this process)."""
    path = tmp_path / "broker.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError):
        load_broker_config(str(path))
    return run_here("broker", "-c", str(path))


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def refused_config(tmp_path: Path, plugin_lines: str, *, top: str = "") -> str:
    """The error of a config the plugin refuses: exit code 2, the text returned."""
    result = refused_here(tmp_path, config_text(tmp_path / "store", plugin_lines, top=top))
    assert result.returncode == 2, output(result)
    assert not (tmp_path / "store").exists()
    return output(result)


# --- configuration.md: whole numbers, numbers, digit limits, keys given twice -----------------------------


def test_whole_number_written_as_float_is_refused_naming_the_integer(tmp_path: Path) -> None:
    """``5.0`` is a YAML float, refused even though it is whole, with ``'max_depth': must be written as an
    integer (5), not 5.0``; exit code 2."""
    assert "'max_depth': must be written as an integer (5), not 5.0" in refused_config(tmp_path, "max_depth: 5.0")


def test_fractional_value_of_whole_number_setting(tmp_path: Path) -> None:
    """``5.5`` ... refused with ``'max_depth': expected a whole number, got 5.5``."""
    assert "'max_depth': expected a whole number, got 5.5" in refused_config(tmp_path, "max_depth: 5.5")


@pytest.mark.parametrize("value", ['"5"', "true"])
def test_string_and_bool_refused_for_whole_number(tmp_path: Path, value: str) -> None:
    """``"5"`` or ``true`` are refused with ``'max_depth': expected a whole number, got ...``."""
    assert "'max_depth': expected a whole number, got " in refused_config(tmp_path, f"max_depth: {value}")


def test_replication_whole_number_float_named_with_prefix(tmp_path: Path) -> None:
    """``'replication.lease_ttl': ...`` for replication's (``must be written as an integer``)."""
    text = refused_config(
        tmp_path,
        "replication:\n  name: a\n  listen: 127.0.0.1:7883\n  coordinator: [http://127.0.0.1:2379]\n  lease_ttl: 5.0",
    )
    assert "'replication.lease_ttl': must be written as an integer (5), not 5.0" in text


def test_integer_of_too_many_digits_in_yaml(tmp_path: Path) -> None:
    """An integer of more than 4300 digits ... anywhere in ``broker.yaml``, is refused naming where it is
    written and its line: ``'max_keepalive': line 11: a value YAML cannot read: an integer of more than 4300
    digits`` (an item of a list ... as ``'-c': 'broker.yaml' line 6: ...``)."""
    text = refused_config(tmp_path, "max_keepalive: " + "9" * 4301)
    assert "'max_keepalive': line 11: a value YAML cannot read: an integer of more than 4300 digits" in text
    text = refused_config(tmp_path, "replication:\n  name: a\n  allow_from: [" + "9" * 4301 + "]")
    assert f"'-c': '{tmp_path / 'broker.yaml'}' line 13: a value YAML cannot read: an integer of more" in text


def test_plugin_key_given_twice_is_named(tmp_path: Path) -> None:
    """A key given twice in one mapping ... stops the broker with an error that names the key (exit code 2)."""
    text = refused_config(tmp_path, "max_depth: 10\nmax_depth: 20")
    assert "max_depth" in text


LISTENER = "listeners:\n  default:\n    type: tcp\n"
NAMED_WHERE_WRITTEN = {
    "plugin-listed-twice": (
        LISTENER
        + "    bind: {bind}\nplugins:\n  - {plugin}:\n      store: {store}\n  - {plugin}:\n      store: {store}\n",
        f"plugins[1].{PLUGIN}",
    ),
    "amqtt-key-twice": (
        LISTENER + "    bind: {bind}\n    bind: {bind}\nplugins:\n  {plugin}:\n    store: {store}\n",
        "listeners.default.bind",
    ),
    "merged-under-the-plugin": (
        LISTENER + "    bind: {bind}\nplugins:\n  {plugin}:\n    <<: {{store: {store}a, store: {store}b}}\n",
        "'<<.store'",
    ),
    "merged-list-item": (
        LISTENER + "    <<: [{{bind: '{bind}', bind: '{bind}'}}]\nplugins:\n  {plugin}:\n    store: {store}\n",
        "'listeners.default.<<[0].bind'",
    ),
}


@pytest.mark.parametrize("case", NAMED_WHERE_WRITTEN)
def test_a_key_given_twice_is_named_where_it_is_written(tmp_path: Path, case: str) -> None:
    """the plugin listed in two items of a ``plugins:`` list (named ``plugins[1].amqtt_durable.DurableSessionsPlugin``,
    the later item); any other key by its path from the top of the file (``listeners.default.bind``); a mapping
    merged with ``<<:`` too, named where it is written: ``<<.store`` for one under the plugin's key,
    ``listeners.default.<<[0].bind`` for an item of a merged list; exit code 2."""
    template, named = NAMED_WHERE_WRITTEN[case]
    text = template.format(bind=f"{HOST}:{free_port()}", plugin=PLUGIN, store=tmp_path / "store")
    result = refused_here(tmp_path, text)
    assert result.returncode == 2, output(result)
    assert named in output(result), output(result)


def test_unknown_key_lists_accepted_ones(tmp_path: Path) -> None:
    """``amqtt_durable config: '<key>': <problem>`` with exit code 2 ... An unknown key lists the accepted
    ones."""
    text = refused_config(tmp_path, "max_dept: 5")
    assert "amqtt_durable config: 'max_dept': " in text
    for key in ("max_depth", "session_expiry", "overflow", "recovery_buffer"):
        assert key in text


def test_max_depth_disconnected_below_max_depth(tmp_path: Path) -> None:
    """``max_depth_disconnected``: must be >= max_depth."""
    text = refused_config(tmp_path, "max_depth: 10\nmax_depth_disconnected: 9")
    assert "'max_depth_disconnected'" in text


def test_max_qos_refused_with_amqtt_text(tmp_path: Path) -> None:
    """a config naming it is refused (``amqtt-durable: broker not started: can not match "max-qos" to any
    data class field``, exit code 1)."""
    result = run_broker_config(tmp_path, config_text(tmp_path / "store", top="max-qos: 1\n"))
    assert result.returncode == 1, output(result)
    assert 'amqtt-durable: broker not started: can not match "max-qos" to any data class field' in output(result)


def test_listeners_of_wrong_type(tmp_path: Path) -> None:
    """a setting of amqtt's own that amqtt refuses, e.g. ``listeners: 5`` (``broker not started: wrong value
    type for field "listeners" ...``): exit 1."""
    text = f"listeners: 5\nplugins:\n  {PLUGIN}:\n    store: {tmp_path / 'store'}\n"
    result = run_broker_config(tmp_path, text)
    assert result.returncode == 1, output(result)
    assert 'broker not started: wrong value type for field "listeners"' in output(result)


@pytest.mark.parametrize("kind", ["missing", "not-yaml", "no-plugin"])
def test_config_file_missing_not_yaml_or_without_plugin(tmp_path: Path, kind: str) -> None:
    """exit code 2 for a bad config (... also a config file that is missing, not YAML, or does not load
    ``amqtt_durable.DurableSessionsPlugin``)."""
    texts = {"missing": None, "not-yaml": "listeners: [\n  : : {\n"}
    no_plugin = f"listeners:\n  default:\n    type: tcp\n    bind: {HOST}:{free_port()}\n"
    result = refused_here(tmp_path, texts.get(kind, no_plugin))
    assert result.returncode == 2, output(result)


# --- configuration.md: settings given in Python -----------------------------------------------------------


def test_python_number_rules() -> None:
    """``Fraction(7, 2)`` becomes ``3.5``; a ``Decimal`` is refused with ``'session_expiry': expected a
    number, got Decimal('1.5')``; ``Fraction(5, 1)`` is refused with ``'max_depth': expected a whole number,
    got Fraction(5, 1)``; one too large for a float: ``must be a finite number, got a number too large for
    one``."""
    config = DurableConfig.from_mapping({"session_expiry": Fraction(7, 2)})
    assert config.session_expiry == 3.5 and isinstance(config.session_expiry, float)
    with pytest.raises(ConfigError, match=r"'session_expiry': expected a number, got Decimal\('1\.5'\)"):
        DurableConfig.from_mapping({"session_expiry": Decimal("1.5")})
    with pytest.raises(ConfigError, match=r"'max_depth': expected a whole number, got Fraction\(5, 1\)"):
        DurableConfig.from_mapping({"max_depth": Fraction(5, 1)})
    with pytest.raises(ConfigError, match="'session_expiry': must be a finite number, got a number too large"):
        DurableConfig.from_mapping({"session_expiry": Fraction(10**400, 1)})
    with pytest.raises(ConfigError, match="'session_expiry': expected a number"):
        DurableConfig.from_mapping({"session_expiry": True})


def test_python_constructor_checks_like_mapping() -> None:
    """Settings given ... to ``DurableConfig(...)`` itself, are checked by these same rules, with the same
    ``ConfigError``; a path object is held as its string; ``Path("")`` is refused as ``""`` is."""
    with pytest.raises(ConfigError) as by_mapping:
        DurableConfig.from_mapping({"max_depth": 5.0})
    with pytest.raises(ConfigError) as by_constructor:
        DurableConfig(max_depth=5.0)  # type: ignore[arg-type]
    assert str(by_mapping.value) == str(by_constructor.value)
    assert DurableConfig(store=Path("/x/y")).store == "/x/y"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'store'"):
        DurableConfig(store=Path(""))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'store'"):
        DurableConfig.from_mapping({"store": ""})


def test_python_huge_integers() -> None:
    """such an integer as a key of a mapping given in Python is refused with ``a key that is an integer of
    more than 4300 digits``, naming the mapping; a ``Fraction`` ... ``'session_expiry': a fraction of an
    integer of more than 4300 digits``; in ``streams[0].max_count`` named so."""
    huge = 10**4400
    with pytest.raises(ConfigError, match="a key that is an integer of more than 4300 digits") as key_error:
        DurableConfig.from_mapping({huge: 1})
    assert PLUGIN in str(key_error.value)
    with pytest.raises(ConfigError, match="'session_expiry': a fraction of an integer of more than 4300 digits"):
        DurableConfig.from_mapping({"session_expiry": Fraction(huge, 3)})
    with pytest.raises(ConfigError, match=r"'streams\[0\]\.max_count': an integer of more than 4300 digits"):
        DurableConfig.from_mapping({"streams": [{"filter": "a/#", "max_count": huge}]})


def test_documented_defaults() -> None:
    """The table's defaults that tests/unit/test_config.py's test_defaults does not check."""
    expected = {
        "max_durable_sessions": 100000,
        "max_connections_per_address": 0,
        "max_keepalive": 0,
        "listen_backlog": 512,
        "attach_limit": 256,
        "max_stream_entries_per_client": 10000,
        "max_pending_control_bytes": 1048576,
        "replication": None,
        "max_session_expiry": 604800,
        "streams": [],
        "stream_window": 1,
        "stream_ack_timeout": 5,
        "session_takeover": "owner-only",
        "max_bytes": 0,
        "max_bytes_disconnected": 0,
    }
    config = DurableConfig()
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("key", "low", "high"),
    [
        ("recovery_buffer", 1, 65535),
        ("max_keepalive", 0, 65535),
        ("listen_backlog", 1, None),
        ("attach_limit", 1, None),
        ("max_depth", 1, None),
    ],
)
def test_range_edges(key: str, low: int, high: int | None) -> None:
    """``1 to 65535``, ``0 to 65535``, ``whole number >= 1``: the edges are taken, one past them refused,
    naming the key."""
    settings = {"max_depth_disconnected": 10**7} if key == "max_depth" else {}
    assert getattr(DurableConfig.from_mapping({**settings, key: low}), key) == low
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DurableConfig.from_mapping({**settings, key: low - 1})
    if high is not None:
        assert getattr(DurableConfig.from_mapping({key: high}), key) == high
        with pytest.raises(ConfigError, match=f"'{key}'"):
            DurableConfig.from_mapping({key: high + 1})


# --- operations.md: inspect and repair refusals -------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "repair"])
def test_a_path_without_a_store_is_refused(tmp_path: Path, command: str) -> None:
    """inspect: a missing or empty folder: ``no store at '...'``; a folder holding other files: ``store folder
    '...' holds files (...) but no LevelDB store``; a file: ``store '...' is a file, not a folder``; each exit
    code 1, and nothing is created. repair: a path that is missing or a folder without LevelDB files (empty,
    or holding only other files: unlike ``inspect``, repair does not say ``holds files``) is refused with ``no
    store at '...'``, a file with ``store '...' is a file, not a folder``; exit code 1, untouched."""
    missing, empty, other, file = (tmp_path / name for name in ("missing", "empty", "other", "file"))
    empty.mkdir()
    other.mkdir()
    (other / "notes.txt").write_text("x")
    file.write_text("x")
    held = f"store folder '{other}' holds files (notes.txt) but no LevelDB store"
    refusals = {
        missing: f"no store at '{missing}'",
        empty: f"no store at '{empty}'",
        other: held if command == "inspect" else f"no store at '{other}'",
        file: f"store '{file}' is a file, not a folder",
    }
    for path, says in refusals.items():
        result = run_here(command, str(path))
        assert result.returncode == 1 and says in output(result), (path, output(result))
        assert command == "inspect" or "holds files" not in output(result), output(result)
    assert not missing.exists() and list(empty.iterdir()) == []
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"] and file.read_text() == "x"


@pytest.mark.parametrize(
    "args", [[], ["STORE", "--replication", "127.0.0.1:7883"], ["--retained", "--replication", "127.0.0.1:7883"]]
)
def test_inspect_usage_errors(tmp_path: Path, args: list[str]) -> None:
    """It takes a store folder or ``--replication HOST:PORT``: neither, both, or ``--retained`` with
    ``--replication`` is a usage error (exit code 2)."""
    result = run_here("inspect", *[str(tmp_path) if a == "STORE" else a for a in args])
    assert result.returncode == 2, output(result)


def test_inspect_replication_malformed_address() -> None:
    """a malformed HOST:PORT is a usage error, exit code 2."""
    result = run_here("inspect", "--replication", "no-port-here")
    assert result.returncode == 2, output(result)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def reverse(a: bytes, b: bytes) -> int:
    """A LevelDB comparator of another program's: keys in reverse order."""
    return (a < b) - (a > b)


@pytest.mark.parametrize(
    ("comparator", "records", "named"),
    [
        (
            None,
            {b"user:1": b"alice"},
            "(no layout version key or store id, and its key b'user:1' has the shape of no key of amqtt-durable's "
            "store layout); nothing was changed. Point repair at the plugin's 'store' folder",
        ),
        (
            reverse,
            {b"v": b"1", b"sclient": b"{}"},
            "(its keys are kept in the order of the comparator 'test.Reverse', not LevelDB's default, which "
            "amqtt-durable uses); nothing was changed.",
        ),
    ],
)
def test_repair_refuses_another_programs_leveldb(
    tmp_path: Path, comparator: Callable[[bytes, bytes], int] | None, records: dict[bytes, bytes], named: str
) -> None:
    """``repair of '...' refused: it is not an amqtt-durable store but another program's LevelDB (no layout
    version key or store id, and its key b'user:1' has the shape of no key of amqtt-durable's store layout);
    nothing was changed. Point repair at the plugin's 'store' folder``, or ``... (its keys are kept in the
    order of the comparator 'NAME', not LevelDB's default, which amqtt-durable uses); nothing was changed.
    ...``; exit code 1, every file as it was."""
    folder = tmp_path / "other-db"
    ordered = {"comparator": comparator, "comparator_name": b"test.Reverse"} if comparator else {}
    db = plyvel.DB(str(folder), create_if_missing=True, **ordered)
    for key, value in records.items():
        db.put(key, value)
    db.close()
    before = folder_bytes(folder)
    result = run_here("repair", str(folder))
    assert result.returncode == 1, output(result)
    assert (
        f"repair of '{folder}' refused: it is not an amqtt-durable store but another program's LevelDB {named}"
    ) in output(result), output(result)
    assert folder_bytes(folder) == before


# --- operations.md / store-layout.md: stores the broker refuses -------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A store with one durable session (client id ``made-1``), its broker stopped: made once, copied by
    each test that uses it (made_store), so no test sees another's changes."""
    broker = Broker(tmp_path_factory.mktemp("blind12-made"))
    try:
        broker.start()
        client = Client(broker.port, "made-1")
        client.subscribe("made/#", qos=1)
        client.disconnect()
    finally:
        broker.stop()
    yield broker.store


@pytest.fixture
def made_store(made: str, broker_factory: Callable[..., Broker]) -> Callable[[], Broker]:
    """A copy of ``made``'s store, for a broker not started (its config written by write_config)."""

    def copy() -> Broker:
        broker = broker_factory(start=False)
        shutil.copytree(made, broker.store)
        return broker

    return copy


def test_store_without_current(made_store: Callable[[], Broker]) -> None:
    """a copy missing LevelDB's ``CURRENT`` file: ``store '...' is corrupted or unreadable: ... CURRENT, the
    file naming the live MANIFEST, is missing``; the files are not touched. (From ``inspect``; the broker's
    refusal: test_docs_promises_store_ops.)"""
    broker = made_store()
    (Path(broker.store) / "CURRENT").unlink()
    before = folder_bytes(Path(broker.store))
    result = run_here("inspect", broker.store)
    assert result.returncode == 1, output(result)
    assert f"store '{broker.store}' is corrupted or unreadable: " in output(result)
    assert "CURRENT, the file naming the live MANIFEST, is missing" in output(result)
    assert folder_bytes(Path(broker.store)) == before


def test_crash_leftovers_count_as_empty(tmp_path: Path, broker_factory: Callable[..., Broker]) -> None:
    """LevelDB's ``LOCK``, ``LOG`` and ``LOG.old`` files alone, left by a crash while creating it, count as
    empty."""
    broker = broker_factory(start=False)
    store = Path(broker.store)
    store.mkdir()
    for name in ("LOCK", "LOG", "LOG.old"):
        (store / name).write_text("")
    broker.start()
    assert (store / "CURRENT").exists()


# --- operations.md: inspect output -------------------------------------------------------------------------


def test_inspect_rows_order_subscriptions_and_json(broker_factory: Callable[..., Broker]) -> None:
    """one row per session in client id order (``B`` before ``a``); subscriptions ``filter@qos``,
    comma-separated, sorted by filter in code-point order, ``-`` for none; the default 300 s just after a
    disconnect reads ``5m``; columns two spaces apart; ``--json`` fields."""
    broker = broker_factory()
    first = Client(broker.port, "a-dev")
    first.subscribe([("z/t", 1), ("Y/t", 0)])
    first.disconnect()
    second = Client(broker.port, "B-dev")
    second.disconnect()
    publisher = Client(broker.port, "pub", clean_session=True)
    publisher.publish("z/t", [b"12345"], qos=1)
    publisher.disconnect()
    broker.stop()
    result = run_here("inspect", broker.store)
    assert result.returncode == 0, output(result)
    lines = result.stdout.splitlines()
    assert lines[0].split("  ")[:1] == ["CLIENT ID"]
    assert [line.split()[0] for line in lines[1:3]] == ["B-dev", "a-dev"]
    b_row, a_row = lines[1].split(), lines[2].split()
    assert b_row[1:3] == ["0", "0"] and b_row[-1] == "-"
    assert a_row[1:3] == ["1", "5"] and a_row[-1] == "Y/t@0,z/t@1"
    assert b_row[4] == "5m" and a_row[4] == "5m"
    assert lines[-1] == "2 session(s), 1 queued message(s)"
    result = run_here("inspect", broker.store, "--json")
    assert result.returncode == 0, output(result)
    rows = json.loads(result.stdout)
    assert [row["client_id"] for row in rows] == ["B-dev", "a-dev"]
    assert set(rows[0]) == {
        "client_id",
        "depth",
        "bytes",
        "oldest_age_s",
        "subscriptions",
        "disconnected_at",
        "expires_at",
        "dropped",
    }
    assert rows[1]["subscriptions"] == {"Y/t": 0, "z/t": 1}
    assert rows[1]["depth"] == 1 and rows[1]["bytes"] == 5 and rows[1]["dropped"] == 0
    assert rows[0]["oldest_age_s"] is None
    assert rows[1]["expires_at"] - rows[1]["disconnected_at"] == pytest.approx(300, abs=1)


def test_inspect_escapes_unprintable_client_id(broker_factory: Callable[..., Broker]) -> None:
    """a client id ... shows a backslash and each character that is not printable ... escaped as in a Python
    string (``\\n``, ``\\x1b``); ``--json`` gives them as they are."""
    broker = broker_factory()
    client = Client(broker.port, "evil\n\x1bid")
    client.disconnect()
    broker.stop()
    result = run_here("inspect", broker.store)
    assert result.returncode == 0, output(result)
    assert result.stdout.splitlines()[1].startswith("evil\\n\\x1bid  ")
    assert json.loads(run_here("inspect", broker.store, "--json").stdout)[0]["client_id"] == "evil\n\x1bid"


def test_inspect_retained(broker_factory: Callable[..., Broker]) -> None:
    """With ``--retained`` it lists the retained messages instead, in topic order: topic, QoS, payload bytes
    and age (header ``TOPIC``, ``QOS``, ``BYTES``, ``AGE``), then ``<n> retained message(s)``; ``--json``: a
    list of ``{"topic", "qos", "bytes", "age_s"}``."""
    broker = broker_factory()
    publisher = Client(broker.port, "ret-pub", clean_session=True)
    publisher.publish("r/b", [b"abc"], qos=1, retain=True)
    publisher.publish("r/a", [b"abcdefg"], qos=0, retain=True)
    publisher.publish("r/a", [b"abcdefg"], qos=1, retain=True)
    publisher.disconnect()
    broker.stop()
    result = run_here("inspect", broker.store, "--retained")
    assert result.returncode == 0, output(result)
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["TOPIC", "QOS", "BYTES", "AGE"]
    assert [line.split()[:3] for line in lines[1:3]] == [["r/a", "1", "7"], ["r/b", "1", "3"]]
    assert lines[-1] == "2 retained message(s)"
    rows = json.loads(run_here("inspect", broker.store, "--retained", "--json").stdout)
    assert [set(row) for row in rows] == [{"topic", "qos", "bytes", "age_s"}] * 2
    assert [(row["topic"], row["qos"], row["bytes"]) for row in rows] == [("r/a", 1, 7), ("r/b", 1, 3)]


# --- operations.md: troubleshooting texts for damaged records -------------------------------------------


def test_inspect_names_damage_where_it_reads_it(made_store: Callable[[], Broker]) -> None:
    """``inspect`` names the same damage with the same advice (exit code 1) where it reads it: the store id
    always, the session records when it lists sessions, the retained messages only with ``--retained`` (a
    damaged retained message does not stop the list of sessions, nor a damaged session record
    ``--retained``'s list). (The broker's refusal of each, and repair: test_hostile_damaged_records,
    test_hostile_review_store.) One store, each damage undone before the next."""
    broker = made_store()
    cases = [
        (b"smade-1", b"{not json", "the session record of client id 'made-1' does not decode", [[]]),
        (b"i", b"abc", "the store id: 3 bytes that do not decode", [[], ["--retained"]]),
        (
            b"rsome/topic",
            b"\x00",
            "the retained message of topic 'some/topic': 1 bytes that do not decode",
            [["--retained"]],
        ),
    ]
    for key, value, expected, refused_by in cases:
        db = plyvel.DB(broker.store)
        kept = db.get(key)
        db.put(key, value)
        db.close()
        for args in ([], ["--retained"]):
            result = run_here("inspect", broker.store, *args)
            if args in refused_by:
                assert result.returncode == 1 and expected in output(result), (key, args, output(result))
                assert f"store '{broker.store}' is corrupted or unreadable: " in output(result)
                assert f"run 'amqtt-durable repair {broker.store}'" in output(result)
            else:
                assert result.returncode == 0, (key, args, output(result))
        db = plyvel.DB(broker.store)
        if kept is None:
            db.delete(key)
        else:
            db.put(key, kept)
        db.close()


def test_inspect_columns_as_wide_as_widest_cell(broker_factory: Callable[..., Broker]) -> None:
    """each column as wide as its widest cell, counted in characters of the escaped text, header included, and
    two spaces between columns, trailing spaces cut."""
    broker = broker_factory()
    long_id = "a-very-long-client-identifier"
    client = Client(broker.port, long_id)
    client.subscribe("w/#", qos=2)
    client.disconnect()
    broker.stop()
    lines = run_here("inspect", broker.store).stdout.splitlines()
    width = len(long_id)
    assert lines[0].startswith("CLIENT ID" + " " * (width - len("CLIENT ID") + 2) + "DEPTH  BYTES  ")
    assert lines[1].startswith(long_id + "  0" + " " * (len("DEPTH") - 1) + "  0")
    assert lines[1].endswith("  w/#@2") and lines[0].endswith("  SUBSCRIPTIONS")
    assert all(line == line.rstrip() for line in lines)


# --- configuration.md: limits as a client meets them ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('store: ""', "store"),
        ("session_expiry: .inf", "session_expiry"),
        ("session_expiry: -1", "session_expiry"),
        ("overflow: drop-middle", "overflow"),
        ("sync: 1", "sync"),
        ("max_depth: 0", "max_depth"),
    ],
)
def test_bad_values_named(tmp_path: Path, line: str, key: str) -> None:
    """``store``: non-empty path; ``session_expiry``: finite number >= 0; ``overflow``: ``drop-oldest`` /
    ``drop-newest``; ``sync``: ``true`` / ``false``; ``max_depth``: whole number >= 1. Refused naming the key,
    exit code 2."""
    if key == "store":
        result = refused_here(tmp_path, config_text(tmp_path / "store").replace(f"store: {tmp_path / 'store'}", line))
        assert result.returncode == 2, output(result)
        text = output(result)
    else:
        text = refused_config(tmp_path, line)
    assert f"amqtt_durable config: '{key}': " in text and "given twice" not in text, text


def test_inspect_due_and_ages(broker_factory: Callable[..., Broker]) -> None:
    """ages and times read ``45s`` (under 2 minutes ...); an expiry already past ``due`` (the broker deletes
    that session when it starts); ``--json``: times in Unix seconds."""
    broker = broker_factory(session_expiry=2, metrics_interval=1)
    sub = Client(broker.port, "due-1")
    sub.subscribe("due/t", qos=1)
    sub.disconnect()
    watcher = Client(broker.port, "due-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/sessions/disconnected", qos=0)
    publisher = Client(broker.port, "due-pub", clean_session=True)
    publisher.publish("due/t", [b"abc"], qos=1)
    publisher.disconnect()
    assert watcher.wait_for(lambda msgs: any(m.payload == b"1" for m in msgs), 3 * WAIT)
    watcher.disconnect()
    broker.stop()
    stopped = time.time()
    (row,) = json.loads(run_here("inspect", broker.store, "--json").stdout)
    assert row["client_id"] == "due-1" and row["depth"] == 1
    assert stopped - 3 * WAIT < row["disconnected_at"] <= stopped
    assert row["expires_at"] == pytest.approx(row["disconnected_at"] + 2, abs=0.01)
    deadline = time.monotonic() + 3 * WAIT
    while time.time() <= row["expires_at"] and time.monotonic() < deadline:
        threading.Event().wait(0.1)
    line = run_here("inspect", broker.store).stdout.splitlines()[1].split()
    assert line[0] == "due-1" and line[4] == "due", line
    assert re.fullmatch(r"\d+s", line[3]), line


# --- store-layout.md / operations.md: keys, repair's judgement of a folder ---------------------------------


def test_store_keys_version_and_id(made_store: Callable[[], Broker]) -> None:
    """The version is stored under key ``v``; the store id ``i`` (an 8-byte value)."""
    broker = made_store()
    db = plyvel.DB(broker.store)
    assert db.get(b"v") == b"1"
    store_id = db.get(b"i")
    assert store_id is not None and len(store_id) == 8
    db.close()


def test_repair_names_a_long_foreign_key_cut_at_40_bytes(tmp_path: Path) -> None:
    """(the first such key, as Python writes bytes, cut at 40 bytes with ``, ...``)."""
    folder = tmp_path / "long-db"
    key = b"z" * 60
    db = plyvel.DB(str(folder), create_if_missing=True)
    db.put(key, b"1")
    db.close()
    result = run_here("repair", str(folder))
    assert result.returncode == 1, output(result)
    assert f"and its key {key[:40]!r}, ... has the shape of no key" in output(result), output(result)


def test_repair_takes_a_folder_of_layout_shaped_keys(tmp_path: Path) -> None:
    """``repair`` takes a LevelDB folder ... when every key it holds has the shape of a key of this layout
    (``s`` followed by UTF-8, ``r`` followed by UTF-8, ...): it gets the layout version key."""
    folder = tmp_path / "shaped"
    db = plyvel.DB(str(folder), create_if_missing=True)
    db.put(b"rsome/topic", b"\xff")
    db.close()
    result = run_here("repair", str(folder))
    assert result.returncode == 0, output(result)
    db = plyvel.DB(str(folder))
    assert db.get(b"v") == b"1"
    db.close()


def test_inspect_escapes_filters_and_sorts_ids_as_sent(broker_factory: Callable[..., Broker]) -> None:
    """spaces, commas and ``@`` show as they are; ``\\u200d``, ``\\xa0`` escaped; client ids and filters are
    sorted as the clients sent them, not as escaped."""
    broker = broker_factory()
    first = Client(broker.port, "a\x01")
    first.subscribe("x y,z@w\u200d\xa0", qos=1)
    first.disconnect()
    second = Client(broker.port, "a\\")
    second.disconnect()
    broker.stop()
    lines = run_here("inspect", broker.store).stdout.splitlines()
    assert lines[1].startswith("a\\x01  ") and lines[2].startswith("a\\\\  "), lines
    assert lines[1].endswith("  x y,z@w\\u200d\\xa0@1"), lines


def test_python_streams_tuple_held_as_list() -> None:
    """both take ``streams`` as a list (or a tuple, held as a list) of entries."""
    config = DurableConfig.from_mapping({"streams": ({"filter": "a/#"},)})
    assert isinstance(config.streams, list) and len(config.streams) == 1
    assert config.streams[0].filter == "a/#"


# --- operations.md: a full disk ---------------------------------------------------------------------------


def test_repair_on_a_full_disk_and_a_read_only_one(tmp_path: Path, made_store: Callable[[], Broker]) -> None:
    """If the disk is full: ``repair of '...' not started: its folder cannot take the writes a repair needs (No
    space left on device: it needs N MB free, twice the store's table and log files plus 1 MB); nothing was
    changed. Free space on the store's disk, then run repair again`` (N: twice the size of the store's
    ``.ldb``, ``.sst`` and ``.log`` files plus 1 MiB, 1,048,576 bytes, in megabytes of 10^6 bytes with one
    decimal); read-only: ``repair of '...' not started:
    its folder cannot be written (Read-only file system); nothing was changed``; exit code 1 either way."""
    source = made_store()
    with small_disk(tmp_path / "disk", 8) as disk:
        store = disk / "store"
        subprocess.run(["cp", "-a", source.store, str(store)], check=True, timeout=WAIT)
        filler = fill(disk)
        before = folder_bytes(store)
        files = sum(len(data) for name, data in before.items() if name.endswith((".ldb", ".sst", ".log")))
        result = run_here("repair", str(store))
        assert result.returncode == 1, output(result)
        assert (
            f"repair of '{store}' not started: its folder cannot take the writes a repair needs (No space left on "
            f"device: it needs {(2 * files + 1_048_576) / 1e6:.1f} MB free, twice the store's table and log files "
            "plus 1 MB); nothing was changed. Free space on the store's disk, then run repair again"
        ) in output(result), output(result)
        assert folder_bytes(store) == before
        assert not (store / "durable-write-probe.tmp").exists()
        filler.unlink()
        remount_read_only(disk)
        result = run_here("repair", str(store))
        assert result.returncode == 1, output(result)
        assert (
            f"repair of '{store}' not started: its folder cannot be written (Read-only file system); nothing was "
            "changed"
        ) in output(result), output(result)


def test_repair_rebuilds_totals_and_restarts_dropped(broker_factory: Callable[..., Broker]) -> None:
    """dropped count (since the session was created, across restarts and reconnects; a repair that rebuilds
    missing or undecodable queue totals starts it at 0); repair rebuilds queue totals that are missing."""
    broker = broker_factory(max_depth=2, max_depth_disconnected=2)
    sub = Client(broker.port, "tot-1")
    sub.subscribe("tot/t", qos=1)
    sub.disconnect()
    publisher = Client(broker.port, "tot-pub", clean_session=True)
    publisher.publish("tot/t", [b"m1", b"m2", b"m3"], qos=1)
    publisher.disconnect()
    broker.stop()
    broker.start()
    broker.stop()
    (row,) = json.loads(run_here("inspect", broker.store, "--json").stdout)
    assert (row["depth"], row["bytes"], row["dropped"]) == (2, 4, 1)
    db = plyvel.DB(broker.store)
    totals = [k for k, _ in db.iterator(prefix=b"t") if len(k) == 9]
    assert len(totals) == 1
    db.delete(totals[0])
    db.close()
    result = run_here("repair", broker.store)
    assert result.returncode == 0, output(result)
    assert any(line.startswith("  rebuilt: ") for line in result.stdout.splitlines()), result.stdout
    (row,) = json.loads(run_here("inspect", broker.store, "--json").stdout)
    assert (row["depth"], row["bytes"], row["dropped"]) == (2, 4, 0)


def test_repair_quotes_client_ids_as_repr(made_store: Callable[[], Broker]) -> None:
    """a client id ... in quotes as Python's ``repr()`` writes a string: ``client '...'``, or ``client "..."``
    for one holding a ``'`` and no ``"``; what it could not recover: records it could not match (removed: that
    client starts a new session), each on a line indented two spaces, ``not recovered: ...``."""
    broker = made_store()
    db = plyvel.DB(broker.store)
    db.put(b"sit's", b"{bad")
    db.put(b"sa\"b'c\n", b"{bad")
    db.close()
    result = run_here("repair", broker.store)
    assert result.returncode == 0, output(result)
    lines = result.stdout.splitlines()
    assert any(line.startswith('  not recovered: client "it\'s": ') for line in lines), lines
    assert any(line.startswith("  not recovered: client 'a\"b\\'c\\n': ") for line in lines), lines
    assert len(lines) == 3


def test_earlier_stream_log_keys_are_converted(broker_factory: Callable[..., Broker]) -> None:
    """A store written by an earlier release (events keyed by topic, a NUL byte and the id) is converted when
    the broker opens it ...; events and id marks of topics no client may publish to (U+0000 in them) are
    dropped, with a WARNING that counts them."""
    broker = broker_factory(streams=[{"filter": "tele/#", "max_count": 100, "max_age": 0}])
    publisher = Client(broker.port, "conv-pub", clean_session=True)
    publisher.publish("tele/a", [b"e1", b"e2"], qos=1)
    publisher.disconnect()
    broker.stop()
    db = plyvel.DB(broker.store)
    events = [(k, v) for k, v in db.iterator(prefix=b"e")]
    assert len(events) == 2
    topic = b"tele/a"
    for key, value in events:
        assert topic in key
        db.delete(key)
        db.put(b"l" + topic + b"\x00" + key[-8:], value)
    db.put(b"l" + b"te\x00le/b" + b"\x00" + events[0][0][-8:], events[0][1])
    db.close()
    before = len(broker.log())
    broker.start()
    broker.stop()
    log = broker.log()[before:]
    warning = [line for line in log.splitlines() if "WARNING" in line and "1" in line and "U+0000" in line]
    assert warning, log
    db = plyvel.DB(broker.store)
    assert [k for k, _ in db.iterator(prefix=b"l")] == []
    assert sorted(k for k, _ in db.iterator(prefix=b"e")) == sorted(k for k, _ in events)
    db.close()


def test_documented_ranges() -> None:
    """The table's ranges: ``stream_window`` 1 to 1000, ``stream_ack_timeout`` > 0, ``max_packet_size`` 1024 to
    268435455, ``max_bytes_disconnected`` >= ``max_bytes`` when both are set."""
    for key, good, bad in (
        ("stream_window", [1, 1000], [0, 1001]),
        ("max_packet_size", [1024, 268435455], [1023, 268435456]),
        ("stream_ack_timeout", [0.001], [0]),
    ):
        for value in good:
            assert getattr(DurableConfig.from_mapping({key: value}), key) == value
        for value in bad:
            with pytest.raises(ConfigError, match=f"'{key}'"):
                DurableConfig.from_mapping({key: value})
    assert DurableConfig.from_mapping({"max_bytes": 10, "max_bytes_disconnected": 10}).max_bytes_disconnected == 10
    assert DurableConfig.from_mapping({"max_bytes": 10}).max_bytes_disconnected == 0
    with pytest.raises(ConfigError, match="'max_bytes_disconnected'"):
        DurableConfig.from_mapping({"max_bytes": 10, "max_bytes_disconnected": 9})


def test_max_packet_size_edge(broker_factory: Callable[..., Broker]) -> None:
    """``max_packet_size``: Largest packet a client may send (remaining length, bytes); a larger one closes the
    connection before its body is read."""
    broker = broker_factory(max_packet_size=1024)
    topic = "mp/t"
    for extra, closed in ((0, False), (1, True)):
        payload_size = 1024 - 2 - len(topic) - 2 + extra  # QoS 1: topic length, topic, packet id, payload
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            connect = mqtt_string("MQTT") + bytes([4, 0x02, 0, 30]) + mqtt_string(f"mp-{extra}")
            sock.sendall(mqtt_packet(0x10, connect))
            assert sock.recv(4) == b"\x20\x02\x00\x00"
            sock.sendall(mqtt_packet(0x32, mqtt_string(topic) + b"\x00\x07" + bytes(payload_size)))
            reply = sock.recv(4)
            if closed:
                assert reply == b"", reply
            else:
                assert reply == b"\x40\x02\x00\x07", reply


def test_max_subscriptions_per_client(broker_factory: Callable[..., Broker]) -> None:
    """a SUBSCRIBE past it gets return code 0x80 for the filters over the limit (logged as a WARNING ...).
    Re-subscribing to a held filter does not count twice."""
    broker = broker_factory(max_subscriptions_per_client=2)
    client = Client(broker.port, "subs-1")
    assert client.subscribe([("s/a", 1), ("s/b", 1), ("s/c", 1)]) == [1, 1, 0x80]
    assert client.subscribe("s/a", qos=0) == [0]
    assert client.subscribe("s/d", qos=0) == [0x80]
    client.disconnect()
    warning = next(line for line in broker.log().splitlines() if "subs-1" in line and "WARNING" in line)
    assert "2" in warning


@pytest.mark.parametrize("command", ["inspect", "promote"])
def test_replication_address_forms(command: str) -> None:
    """``inspect --replication`` and ``promote`` talk to a running broker over its ``replication.listen``
    address (an IPv6 address in brackets, ``[::1]:7883``; a malformed HOST:PORT is a usage error, exit code
    2)."""
    args = ["--replication"] if command == "inspect" else []
    port = free_port()
    for malformed in ("::1:7883", "127.0.0.1", "127.0.0.1:port", "127.0.0.1:70000"):
        result = run_here(command, *args, malformed)
        assert result.returncode == 2, (malformed, output(result))
    result = run_here(command, *args, f"[::1]:{port}")
    assert result.returncode not in (0, 2), output(result)


def test_repair_clears_replication_position_rebuilt_lines_first(made_store: Callable[[], Broker]) -> None:
    """A replicated store's position is cleared too (``rebuilt: replication position cleared``); every
    ``rebuilt:`` line comes before the first ``not recovered:`` line."""
    broker = made_store()
    db = plyvel.DB(broker.store)
    db.put(b"R", (5).to_bytes(8, "big"))
    db.put(b"sgone", b"{bad")
    db.close()
    result = run_here("repair", broker.store)
    assert result.returncode == 0, output(result)
    lines = result.stdout.splitlines()[1:]
    kinds = [line.split(":")[0] for line in lines]
    assert kinds == sorted(kinds, key=lambda kind: kind != "  rebuilt") and "  not recovered" in kinds, lines
    assert any(line.startswith("  rebuilt: replication position cleared") for line in lines), lines
    db = plyvel.DB(broker.store)
    assert db.get(b"R") is None
    db.close()
