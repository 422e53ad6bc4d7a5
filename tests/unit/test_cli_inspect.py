"""The command line: broker.yaml pre-flight check, `inspect` and `repair` on real stores."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from amqtt_durable.cli import EXIT_BAD_INPUT, PLUGIN_PATH, load_broker_config, main, plugin_section
from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import ConfigError, StoreCorruptedError
from amqtt_durable.inspect_store import SessionSummary, _duration, format_table, summarize
from amqtt_durable.store import (
    MSG_ID_MARK_KEY,
    SID_MARK_KEY,
    Body,
    Entry,
    SessionRecord,
    body_key,
    encode_totals,
    entry_key,
    open_store,
    session_key,
    totals_key,
)
from conftest import run_cli

LISTENERS = {"default": {"type": "tcp", "bind": "127.0.0.1:0"}}


def write_yaml(path: Path, config: Any) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


# ------------------------------------------------------------------------ plugin_section


def test_plugin_section_mapping_form() -> None:
    config = {"plugins": {"other.Plugin": {"x": 1}, PLUGIN_PATH: {"sync": True}}}
    assert plugin_section(config) == {"sync": True}


def test_plugin_section_without_settings_is_empty_mapping() -> None:
    assert plugin_section({"plugins": {PLUGIN_PATH: None}}) == {}
    assert plugin_section({"plugins": [PLUGIN_PATH]}) == {}


@pytest.mark.parametrize("value", [0, False, [], ""])
def test_plugin_section_keeps_a_falsy_value_that_is_no_mapping(value: object) -> None:
    """Only ``null`` stands for no settings: the caller names any other non-mapping (exit 2)."""
    assert plugin_section({"plugins": {PLUGIN_PATH: value}}) is value
    assert plugin_section({"plugins": [{PLUGIN_PATH: value}]}) is value


def test_plugin_section_list_form() -> None:
    config = {"plugins": [{"other.Plugin": {}}, {PLUGIN_PATH: {"max_depth": 5}}]}
    assert plugin_section(config) == {"max_depth": 5}


@pytest.mark.parametrize(
    "config",
    [{}, {"plugins": None}, {"plugins": {"other.Plugin": {}}}, {"plugins": ["other.Plugin"]}, {"plugins": "x"}],
)
def test_plugin_section_absent(config: dict[str, Any]) -> None:
    assert plugin_section(config) is None


# -------------------------------------------------------------------- load_broker_config


def test_load_good_config(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "broker.yaml",
        {"listeners": LISTENERS, "plugins": {PLUGIN_PATH: {"store": str(tmp_path / "s"), "max_depth": 5}}},
    )
    config = load_broker_config(path)
    assert config["listeners"] == LISTENERS
    assert config["plugins"][PLUGIN_PATH]["max_depth"] == 5


def test_load_good_config_list_form(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "broker.yaml", {"listeners": LISTENERS, "plugins": [PLUGIN_PATH]})
    assert load_broker_config(path)["plugins"] == [PLUGIN_PATH]


def test_load_config_without_our_plugin(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "broker.yaml",
        {"listeners": LISTENERS, "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {}}},
    )
    with pytest.raises(ConfigError) as info:
        load_broker_config(path)
    assert info.value.key == "plugins"
    assert PLUGIN_PATH in str(info.value)
    assert path in str(info.value)


def test_load_config_without_plugins_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "broker.yaml", {"listeners": LISTENERS})
    with pytest.raises(ConfigError) as info:
        load_broker_config(path)
    assert info.value.key == "plugins"


def test_load_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text("listeners: [unclosed\nplugins:\n  - {\n")
    with pytest.raises(ConfigError) as info:
        load_broker_config(str(path))
    assert info.value.key == "-c"
    assert "not valid YAML" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_load_yaml_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_broker_config(str(path))
    assert info.value.key == "-c"
    assert "mapping" in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError) as info:
        load_broker_config(path)
    assert info.value.key == "-c"
    assert "cannot read" in str(info.value)
    assert path in str(info.value)


def test_load_config_with_unknown_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "broker.yaml", {"listeners": LISTENERS, "plugins": {PLUGIN_PATH: {"max_depht": 5}}})
    with pytest.raises(ConfigError) as info:
        load_broker_config(path)
    assert info.value.key == "max_depht"
    assert "max_depth" in str(info.value), "the accepted settings are listed"


def test_load_config_with_bad_value_in_list_form(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "broker.yaml", {"listeners": LISTENERS, "plugins": [{PLUGIN_PATH: {"recovery_buffer": 70000}}]}
    )
    with pytest.raises(ConfigError) as info:
        load_broker_config(path)
    assert info.value.key == "recovery_buffer"


def test_broker_command_rejects_bad_key_with_exit_2(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "bad.yaml",
        {"listeners": LISTENERS, "plugins": {PLUGIN_PATH: {"store": str(tmp_path / "s"), "max_depht": 5}}},
    )
    result = run_cli("broker", "-c", path, cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT == 2, result.stderr
    assert "'max_depht'" in result.stderr
    assert "unknown setting" in result.stderr
    assert not (tmp_path / "s").exists(), "the broker must not have started (no store created)"


def test_broker_command_rejects_bad_value_with_exit_2(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "bad.yaml", {"listeners": LISTENERS, "plugins": {PLUGIN_PATH: {"overflow": "x"}}})
    result = run_cli("broker", "-c", path, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "'overflow'" in result.stderr
    assert "drop-oldest" in result.stderr and "drop-newest" in result.stderr


def test_broker_command_rejects_invalid_yaml_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("plugins: {unclosed\n")
    result = run_cli("broker", "-c", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "not valid YAML" in result.stderr


# ----------------------------------------------------------------------------- inspect


def build_store(path: str, now: float) -> None:
    """Three sessions written with the store helpers: a queue, an empty one, a missing body."""
    db = open_store(path)
    try:
        db.put(
            session_key("dev-1"),
            SessionRecord(
                "dev-1",
                1,
                {"sensors/#": 1, "alerts": 2},
                created_at=now - 5000,
                disconnected_at=now - 1200,
                expires_at=now + 3600,
            ).encode(),
        )
        bodies = [(10, now - 1000, b"a" * 100), (11, now - 500, b"b" * 100), (12, now - 10, b"c" * 100)]
        for seq, (msg_id, published_at, payload) in enumerate(bodies, start=5):
            db.put(body_key(msg_id), Body("sensors/t", payload, 1, published_at).encode())
            db.put(entry_key(1, seq), Entry(seq, msg_id, 1, 0, len(payload)).encode())
        db.put(totals_key(1), encode_totals(3, 300, 4))
        db.put(session_key("dev-2"), SessionRecord("dev-2", 2, created_at=now).encode())
        db.put(
            session_key("dev-3"),
            SessionRecord("dev-3", 3, {"x": 0}, created_at=now, expires_at=now - 1).encode(),
        )
        db.put(entry_key(3, 1), Entry(1, 99, 0, 0, 50).encode())  # its body is gone
        db.put(totals_key(3), encode_totals(1, 50, 0))
    finally:
        db.close()


def test_inspect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "store")
    now = time.time()
    build_store(path, now)
    assert main(["inspect", path, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    rows = {row["client_id"]: row for row in json.loads(captured.out)}
    assert list(rows) == ["dev-1", "dev-2", "dev-3"]

    dev1 = rows["dev-1"]
    assert dev1["depth"] == 3
    assert dev1["bytes"] == 300
    assert 1000 <= dev1["oldest_age_s"] < 1060, "age of the first queued message (seq 5, msg 10)"
    assert dev1["expires_at"] == pytest.approx(now + 3600)
    assert dev1["disconnected_at"] == pytest.approx(now - 1200)
    assert dev1["subscriptions"] == {"sensors/#": 1, "alerts": 2}
    assert dev1["dropped"] == 4

    dev2 = rows["dev-2"]
    assert (dev2["depth"], dev2["bytes"], dev2["oldest_age_s"], dev2["expires_at"]) == (0, 0, None, None)

    dev3 = rows["dev-3"]
    assert (dev3["depth"], dev3["bytes"], dev3["oldest_age_s"]) == (1, 50, None)
    assert dev3["expires_at"] == pytest.approx(now - 1)


def test_inspect_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "store")
    build_store(path, time.time())
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["CLIENT", "ID", "DEPTH", "BYTES", "OLDEST", "EXPIRES", "IN", "DROPPED", "SUBSCRIPTIONS"]
    assert lines[1].split()[:3] == ["dev-1", "3", "300"]
    assert lines[-1] == "3 session(s), 4 queued message(s)"


def test_inspect_leaves_the_store_usable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "store")
    build_store(path, time.time())
    assert main(["inspect", path]) == 0
    db = open_store(path)  # inspect closed the store: the lock is free
    db.close()


@pytest.mark.parametrize("option", ["--config", "--secret-file"])
def test_a_replication_option_without_replication_is_a_usage_error(tmp_path: Path, option: str) -> None:
    """operations.md: ``inspect STORE --config FILE`` (or ``--secret-file``) is refused, exit code 2:
    a store is read without them (the option was ignored, the file never read)."""
    store = str(tmp_path / "store")
    build_store(store, time.time())
    given = write_yaml(tmp_path / "broker.yaml", {"plugins": {PLUGIN_PATH: {"store": store}}})
    for args in (("inspect", store, option, given), ("inspect", store, "--retained", option, given)):
        result = run_cli(*args)
        assert (result.returncode, result.stdout) == (2, ""), (args, result.stderr)
        assert "usage: amqtt-durable inspect" in result.stderr, result.stderr
        assert result.stderr.endswith(
            f"amqtt-durable inspect: error: {option} is used with --replication only: a store folder is inspected "
            "without it\n"
        ), result.stderr


def test_only_inspects_help_says_its_secret_options_go_with_replication(capsys: pytest.CaptureFixture[str]) -> None:
    """promote's --config and --secret-file are its own: its help said "inspect: with --replication only"."""
    shown = {}
    for command in ("inspect", "promote"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown[command] = " ".join(capsys.readouterr().out.split())
    assert shown["inspect"].count("(with --replication only)") == 2, shown["inspect"]
    assert "replication only" not in shown["promote"] and "inspect:" not in shown["promote"], shown["promote"]
    assert "--secret-file PATH authenticate with the replication secret held in this file" in shown["promote"]


def test_summarize_and_format_table_with_fixed_now(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    now = 1_700_000_000.0
    build_store(path, now)
    rows = summarize(path, now=now)
    assert [r.oldest_age_s for r in rows] == [pytest.approx(1000.0), None, None]
    table = format_table(rows, now=now).splitlines()
    assert table[1].split() == ["dev-1", "3", "300", "17m", "60m", "4", "alerts@2,sensors/#@1"]
    assert table[2].split() == ["dev-2", "0", "0", "-", "-", "0", "-"]
    assert table[3].split() == ["dev-3", "1", "50", "-", "due", "0", "x@0"]
    # columns are aligned: every cell of a column starts at the same offset
    assert table[0].index("DEPTH") == table[1].index("3  ") == table[2].index("0  ")


def test_oldest_age_never_negative(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    build_store(path, 1_700_000_000.0)
    rows = summarize(path, now=1_699_998_000.0)  # the clock went back
    assert rows[0].oldest_age_s == 0.0


def test_an_oldest_age_of_0_reads_as_an_age_not_due() -> None:
    """operations.md: OLDEST is an age (`0s` ...); `due` is only an expiry already past."""
    row = SessionSummary("c", 1, 2, 0.0, {"a": 1}, None, 1_000.0, 0)
    assert format_table([row], now=1_000.0).splitlines()[1].split() == ["c", "1", "2", "0s", "due", "0", "a@1"]


def test_the_header_is_exact_for_narrow_cells_and_padded_to_the_widest_cell() -> None:
    """operations.md: "each column as wide as its widest cell, header included, and two spaces between
    columns, trailing spaces cut: the header reads `CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES IN  DROPPED
    SUBSCRIPTIONS` only while no cell is wider than its column's name"."""
    exact = "CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES IN  DROPPED  SUBSCRIPTIONS"
    narrow = SessionSummary("c", 1, 2, None, {"a": 1}, None, None, 0)
    assert format_table([narrow], now=0.0).splitlines()[0] == exact
    wide = SessionSummary("a-long-client-id", 1, 2, None, {"a": 1}, None, None, 0)
    table = format_table([wide], now=0.0).splitlines()
    assert table[0] == "CLIENT ID".ljust(len("a-long-client-id")) + exact.removeprefix("CLIENT ID")
    assert table[1] == "a-long-client-id  1      2      -       -           0        a@1"


def test_format_table_empty() -> None:
    text = format_table([], now=0.0)
    assert text.splitlines()[-1] == "0 session(s), 0 queued message(s)"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "due"),
        (0, "due"),
        (45, "45s"),
        (119, "119s"),
        (120, "2m"),
        (7199, "120m"),
        (7200, "2.0h"),
        (90000, "25.0h"),
    ],
)
def test_durations(seconds: float, text: str) -> None:
    assert _duration(seconds) == text


def test_session_summary_as_json() -> None:
    row = SessionSummary("c", 1, 2, None, {"a": 1}, None, 5.0, 0)
    assert row.as_json() == {
        "client_id": "c",
        "depth": 1,
        "bytes": 2,
        "oldest_age_s": None,
        "subscriptions": {"a": 1},
        "disconnected_at": None,
        "expires_at": 5.0,
        "dropped": 0,
    }


def test_inspect_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "missing")
    assert main(["inspect", path]) == 1
    err = capsys.readouterr().err
    assert "no store at" in err and path in err
    assert not os.path.exists(path), "inspect must never create a store"


def test_inspect_locked_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "store")
    build_store(path, time.time())
    holder = open_store(path)
    try:
        assert main(["inspect", path]) == 1
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert "is locked" in err and path in err


def test_inspect_corrupted_table_reports_error_not_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The LevelDB open succeeds (the version key's block is intact); the damage is found
    # while inspect reads the first message body. The user must get the store error with
    # the 'repair' hint (exit 1), not a raw plyvel.CorruptionError traceback.
    path = str(tmp_path / "store")
    now = time.time()
    db = open_store(path)
    db.put(session_key("dev"), SessionRecord("dev", 1, created_at=now).encode())
    for seq in range(1, 201):
        db.put(body_key(seq), Body("t", b"x" * 200, 1, now).encode())
        db.put(entry_key(1, seq), Entry(seq, seq, 1, 0, 200).encode())
    db.put(totals_key(1), encode_totals(200, 40_000, 0))
    db.compact_range()
    db.close()
    tables = [name for name in os.listdir(path) if name.endswith(".ldb")]
    assert tables
    for name in tables:
        data = bytearray(Path(path, name).read_bytes())
        data[10:60] = b"\xff" * 50  # inside the first data block (message bodies)
        Path(path, name).write_bytes(bytes(data))
    code = main(["inspect", path])
    err = capsys.readouterr().err
    assert code == 1
    assert "corrupted" in err and f"amqtt-durable repair {path}" in err


@pytest.mark.parametrize(
    ("key", "named"),
    [(MSG_ID_MARK_KEY, "the highest message id"), (SID_MARK_KEY, "the highest session number")],
)
@pytest.mark.parametrize("retained", [False, True])
def test_inspect_names_a_damaged_mark_as_start_up_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: bytes, named: str, retained: bool
) -> None:
    path = str(tmp_path / "store")
    build_store(path, time.time())
    db = open_store(path)
    db.put(key, b"\x01\x02\x03")  # a mark is 8 bytes
    db.close()
    with pytest.raises(StoreCorruptedError) as start_up:
        DurableEngine(DurableConfig(store=path)).open()
    assert f"{named}: 3 bytes that do not decode" in str(start_up.value)
    code = main(["inspect", path, *(["--retained"] if retained else [])])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert captured.err.strip().endswith(str(start_up.value)), captured.err


# ------------------------------------------------------------------------------ repair


def test_repair_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "store")
    now = time.time()
    build_store(path, now)
    Path(path, "CURRENT").write_bytes(b"garbage\n")
    assert main(["inspect", path]) == 1
    assert "corrupted" in capsys.readouterr().err
    assert main(["repair", path]) == 0
    out = capsys.readouterr().out
    assert f"repaired '{path}'" in out
    # dev-3's only entry has no message body: removed, reported, and its totals follow the queue.
    assert "not recovered: client 'dev-3': 1 queued message(s) unreadable (removed)" in out
    assert "rebuilt: client 'dev-3': queue totals rebuilt from the queue: 0 message(s), 0 bytes" in out
    assert [row.depth for row in summarize(path, now=now)] == [3, 0, 0]


def test_repair_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "missing")
    assert main(["repair", path]) == 1
    assert "no store at" in capsys.readouterr().err


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err
