"""DurableConfig.from_mapping: types, ranges and messages that name the offending key."""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from amqtt_durable.cli import load_broker_config
from amqtt_durable.config import OVERFLOW_POLICIES, DurableConfig, StreamConfig
from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.settings import WrittenFloat, seconds_text

# key -> (a good value, bad-type values, out-of-range values)
CASES: dict[str, tuple[Any, list[Any], list[Any]]] = {
    "store": ("/tmp/x", [5, 1.5, True, ["a"], {"a": 1}], [""]),
    "sync": (True, ["yes", 1, 0, None, "true"], []),
    "session_expiry": (60, ["300", True, None, [1]], [-1, -0.001]),
    "max_depth": (10, [1.5, "10", True, None, 10.0], [0, -5]),
    "max_depth_disconnected": (2_000_000, [1.5, "10", False, None], [0, -1]),
    "overflow": ("drop-newest", [5, None, True, ["drop-oldest"]], ["drop-all", "DROP-OLDEST", "drop_oldest", ""]),
    "recovery_buffer": (65535, [1.0, "100", True, None], [0, -1, 65536, 100_000]),
    "queue_qos0": (True, ["no", 0, 1, None], []),
    "batch_size": (1, [2.5, "5000", True, None], [0, -1]),
    "batch_delay_ms": (0, ["10", True, None, {}], [-1, -0.5]),
    "pending_threshold": (1, [1.5, "100", False, None], [0, -100]),
    "metrics_interval": (0, ["10", True, None], [-1, -0.1]),
    "drop_log_interval": (0.5, ["10", False, None], [-1]),
    "max_session_expiry": (3600, ["1h", True, None], [-1]),
    "streams": ([{"filter": "a/#", "max_count": 5, "max_age": 60}], ["a/#", 5, {"filter": "a/#"}, None], []),
    "stream_window": (1000, [1.5, "1", True, None], [0, 1001]),
    "stream_ack_timeout": (0.5, ["5", True, None], [0, -1]),
    "session_takeover": ("any-user", [5, None, True, ["owner-only"]], ["anyone", "ANY-USER", "owner_only", ""]),
    "connect_timeout": (0.5, ["10", True, None], [0, -1]),
    "connection_end_wait": (0.5, ["5", True, None], [0, -1]),
    "max_packet_size": (268_435_455, [1.5, "1MB", True, None], [1023, 0, 268_435_456]),
    "max_bytes": (1_000_000, [1.5, "1MB", True, None], [-1]),
    "max_bytes_disconnected": (0, [2.5, "1", False, None], [-1]),
    "max_subscriptions_per_client": (0, [1.5, "1000", True, None], [-1]),
    "max_subscription_bytes_per_client": (0, [1.5, "1MB", True, None], [-1]),
    "max_pending_clean": (0, [1.5, "1000", True, None], [-1]),
    "max_pending_bytes_clean": (0, [2.5, "16MB", False, None], [-1]),
    "max_awaiting_pubrel": (0, [1.5, "1000", True, None], [-1]),
    "max_stream_entries_per_client": (0, [1.5, "10000", True, None], [-1]),
    "max_pending_control_bytes": (0, [2.5, "1MB", False, None], [-1]),
    "max_durable_sessions": (0, [1.5, "100k", True, None], [-1]),
    "max_connections_per_address": (1, [2.5, "10", False, None], [-1]),
    "max_keepalive": (65_535, [1.5, "60", True, None], [-1, 65_536]),
    "listen_backlog": (1, [1.5, "4096", True, None], [0, -1]),
    "attach_limit": (1, [1.5, "64", True, None], [0, -1]),
    # Its own settings' checks name replication.<key>: tests/unit/test_replication_config.py.
    "replication": ({"role": "primary"}, ["primary", 5, True, ["a"]], []),
}

FLOAT_KEYS = [f.name for f in dataclasses.fields(DurableConfig) if f.type == "float"]


def bad_type_cases() -> list[tuple[str, Any]]:
    return [(key, value) for key, (_, bad, _) in CASES.items() for value in bad]


def bad_range_cases() -> list[tuple[str, Any]]:
    return [(key, value) for key, (_, _, bad) in CASES.items() for value in bad]


def test_cases_cover_every_setting() -> None:
    assert set(CASES) == {f.name for f in dataclasses.fields(DurableConfig)}


def test_defaults() -> None:
    config = DurableConfig.from_mapping({})
    assert config == DurableConfig()
    assert config.store == "./data/durable"
    assert config.sync is False
    assert config.session_expiry == 300.0
    assert config.max_depth == 100_000
    assert config.max_depth_disconnected == 1_000_000
    assert config.overflow == "drop-oldest"
    assert config.recovery_buffer == 100
    assert config.queue_qos0 is False
    assert config.batch_size == 5000
    assert config.batch_delay_ms == 10.0
    assert config.pending_threshold == 100
    assert config.metrics_interval == 10.0
    assert config.drop_log_interval == 10.0
    assert config.connect_timeout == 10.0
    assert config.connection_end_wait == 5.0
    assert config.max_packet_size == 1_048_576
    assert config.max_subscriptions_per_client == 1000
    assert config.max_subscription_bytes_per_client == 1_048_576
    assert config.max_pending_clean == 10_000
    assert config.max_pending_bytes_clean == 16_777_216
    assert config.max_awaiting_pubrel == 1000


def test_none_means_defaults() -> None:
    assert DurableConfig.from_mapping(None) == DurableConfig()


@pytest.mark.parametrize("raw", [0, False, [], ""])
def test_a_falsy_section_that_is_no_mapping_is_refused(raw: Any) -> None:
    """Only None means defaults: a 0, false, [] or "" under the plugin's key is no mapping of settings."""
    with pytest.raises(ConfigError, match="expected a mapping of settings"):
        DurableConfig.from_mapping(raw)


def test_every_good_value_is_accepted() -> None:
    raw = {key: good for key, (good, _, _) in CASES.items()}
    config = DurableConfig.from_mapping(raw)
    for key, value in raw.items():
        if key not in ("streams", "replication"):
            assert getattr(config, key) == value
    assert config.streams == [StreamConfig("a/#", max_count=5, max_age=60.0)]
    assert config.replication == ReplicationConfig(role="primary")


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_whole_numbers_become_floats(key: str) -> None:
    config = DurableConfig.from_mapping({key: 7})
    value = getattr(config, key)
    assert value == 7.0
    assert isinstance(value, float)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_a_fraction_of_seconds_is_a_float_given_either_way(key: str) -> None:
    """configuration.md: a *number* setting takes any real number given in Python, a Fraction too, as
    a float, in DurableConfig(...) as in from_mapping (the direct path kept the Fraction itself)."""
    for config in (DurableConfig(**{key: Fraction(7, 2)}), DurableConfig.from_mapping({key: Fraction(7, 2)})):
        value = getattr(config, key)
        assert value == 3.5
        assert isinstance(value, float)


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(DurableConfig) if f.type == "int"])
def test_a_fraction_for_a_whole_number_setting_is_refused_either_way(key: str) -> None:
    """DurableConfig(max_depth=Fraction(5, 1)) was accepted while from_mapping refused it."""
    messages = []
    for make in (
        lambda: DurableConfig(**{key: Fraction(5, 1)}),
        lambda: DurableConfig.from_mapping({key: Fraction(5, 1)}),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        messages.append(str(info.value))
    assert messages == [f"amqtt_durable config: '{key}': expected a whole number, got Fraction(5, 1)"] * 2


@pytest.mark.parametrize("key", ["loop_wait", "demote_margin", "ack_timeout"])
def test_a_fraction_in_replication_is_its_float_and_its_checks_read_it(key: str) -> None:
    """Replication's number settings share the same rules: a Fraction is the float it becomes, also
    where replication reads a setting back exactly (its loop_wait check: the Fraction's repr,
    ``Fraction(1, 4)``, was read as a number's text, a ValueError from a setting the rules took)."""
    config = DurableConfig.from_mapping({"replication": {"role": "primary", key: Fraction(1, 4)}})
    assert getattr(config.replication, key) == 0.25
    assert repr(getattr(config.replication, key)) == "0.25"
    with pytest.raises(ConfigError, match=r"'replication\.loop_wait': must be at most"):
        DurableConfig.from_mapping({"replication": {"role": "primary", "loop_wait": Fraction(10, 1)}})


def test_a_fraction_too_large_for_a_float_is_refused_naming_the_setting() -> None:
    for make in (
        lambda: DurableConfig(session_expiry=Fraction(10**400, 3)),
        lambda: DurableConfig.from_mapping({"session_expiry": Fraction(10**400, 3)}),
    ):
        with pytest.raises(ConfigError, match="'session_expiry': must be a finite number, got a number too large"):
            make()


def test_a_secret_broker_yaml_writes_as_a_float_too_large_for_one_is_said_to_be_a_float(tmp_path: Path) -> None:
    """broker.yaml's 1.0e+400 is held as a float of the plugin's own class: the error named that class
    ("a value of type TooLargeFloat"), as 1.5 is a float."""
    config = tmp_path / "broker.yaml"
    for number in ("1.0e+400", "1.5"):
        plugin = f"{{store: {tmp_path / 'store'}, replication: {{role: primary, secret: {number}}}}}"
        config.write_text(f"plugins:\n  amqtt_durable.DurableSessionsPlugin: {plugin}\n")
        with pytest.raises(ConfigError) as caught:
            load_broker_config(str(config))
        assert str(caught.value) == (
            "amqtt_durable config: 'replication.secret': expected text, got a value of type float (quote it in YAML)"
        )


def _made(make: Any) -> Any:
    try:
        return make()
    except ConfigError as exc:
        return str(exc)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("store", Path("/tmp/x"), "/tmp/x"),
        ("store", 3, "amqtt_durable config: 'store': expected a non-empty folder path, got 3"),
        (
            "store",
            Path(""),  # as "" is: pathlib reads it as Path("."), which cannot be told from it
            "amqtt_durable config: 'store': expected a non-empty folder path, got PosixPath('.') (Path('') is "
            "Path('.'): give the current folder as the text '.')",
        ),
        ("streams", (StreamConfig("a/#"),), [StreamConfig("a/#")]),  # a tuple as a list (accepted before)
        ("streams", [{"filter": "a/#", "max_count": 5}], [StreamConfig("a/#", max_count=5)]),
        ("streams", [StreamConfig("a/#")], [StreamConfig("a/#")]),
        (
            "streams",
            [StreamConfig(3)],  # type: ignore[arg-type]
            "amqtt_durable config: 'streams[0].filter': expected a non-empty topic filter, got 3",
        ),
        (
            "streams",
            [{"max_count": 5}],
            "amqtt_durable config: 'streams[0].filter': missing; every stream names the topic filter it logs",
        ),
        ("replication", {"role": "primary"}, ReplicationConfig(role="primary")),
        ("replication", ReplicationConfig(role="primary"), ReplicationConfig(role="primary")),
        ("session_expiry", np.float64(1.5), 1.5),
        ("session_expiry", np.int64(3), 3.0),
        (
            "session_expiry",
            Decimal("1.5"),
            "amqtt_durable config: 'session_expiry': expected a number, got Decimal('1.5')",
        ),
        ("max_depth", np.int64(5), "amqtt_durable config: 'max_depth': expected a whole number, got np.int64(5)"),
        ("max_depth", Decimal(5), "amqtt_durable config: 'max_depth': expected a whole number, got Decimal('5')"),
    ],
)
def test_the_constructor_and_from_mapping_agree(key: str, value: Any, expected: Any) -> None:
    """configuration.md: a value given to DurableConfig(...) gets from_mapping's result or error (a Path
    for store raised TypeError, a list of mappings for streams AttributeError, in the constructor)."""
    direct = _made(lambda: getattr(DurableConfig(**{key: value}), key))
    mapped = _made(lambda: getattr(DurableConfig.from_mapping({key: value}), key))
    assert direct == mapped == expected


@pytest.mark.parametrize(("key", "value"), bad_type_cases())
def test_bad_type_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({key: value})
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)
    assert repr(value) in str(info.value), "the message should show the rejected value"


def integer_settings() -> list[tuple[dict[str, Any], str]]:
    """Every setting read as an integer (its field is an ``int``): the plugin's, a stream entry's and
    replication's, as (a mapping that sets it to 5.0, the key an error names)."""
    found = [({f.name: 5.0}, f.name) for f in dataclasses.fields(DurableConfig) if f.type == "int"]
    found += [
        ({"streams": [{"filter": "a/#", f.name: 5.0}]}, f"streams[0].{f.name}")
        for f in dataclasses.fields(StreamConfig)
        if f.type == "int"
    ]
    found += [
        ({"replication": {"role": "primary", f.name: 5.0}}, f"replication.{f.name}")
        for f in dataclasses.fields(ReplicationConfig)
        if f.type == "int"
    ]
    return found


@pytest.mark.parametrize(("raw", "key"), integer_settings(), ids=[key for _, key in integer_settings()])
def test_a_whole_float_for_an_integer_setting_is_refused_saying_how_to_write_it(raw: dict[str, Any], key: str) -> None:
    """configuration.md: `5.0` is refused for an integer setting with a message saying to write `5`, not that
    5.0 is not a whole number; `5.5` still gets "expected a whole number"."""
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping(raw)
    assert str(info.value) == f"amqtt_durable config: '{key}': must be written as an integer (5), not 5.0"
    fraction = yaml.safe_load(yaml.safe_dump(raw).replace("5.0", "5.5"))
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping(fraction)
    assert str(info.value) == f"amqtt_durable config: '{key}': expected a whole number, got 5.5"


def test_integer_settings_cover_the_plugin_streams_and_replication() -> None:
    keys = {key for _, key in integer_settings()}
    assert {"max_depth", "listen_backlog", "streams[0].max_count", "replication.retained_batches"} <= keys
    assert len(keys) >= 25, sorted(keys)


@pytest.mark.parametrize(("key", "value"), bad_range_cases())
def test_bad_range_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({key: value})
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_is_rejected(key: str) -> None:
    # YAML's `.nan` parses to float('nan') and passes every `< 0` range check. A NaN
    # session_expiry gives NaN deadlines that ExpiryTracker discards as stale (the session
    # never expires); a NaN batch_delay_ms puts a NaN deadline into the loop's timer heap.
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({key: math.nan})
    assert info.value.key == key


def test_range_limits_are_inclusive() -> None:
    config = DurableConfig.from_mapping(
        {
            "max_depth": 1,
            "max_depth_disconnected": 1,
            "recovery_buffer": 1,
            "batch_size": 1,
            "pending_threshold": 1,
            "session_expiry": 0,
            "batch_delay_ms": 0,
            "metrics_interval": 0,
            "drop_log_interval": 0,
        }
    )
    assert config.max_depth == config.max_depth_disconnected == 1
    assert DurableConfig.from_mapping({"recovery_buffer": 65535}).recovery_buffer == 65535


def test_range_message_says_what_is_accepted() -> None:
    with pytest.raises(ConfigError, match="between 1 and 65535") as info:
        DurableConfig.from_mapping({"recovery_buffer": 65536})
    assert "65536" in str(info.value)
    with pytest.raises(ConfigError, match="at least 1"):
        DurableConfig.from_mapping({"batch_size": 0})
    with pytest.raises(ConfigError, match="0 or more"):
        DurableConfig.from_mapping({"session_expiry": -5})


def test_unknown_key_lists_accepted_keys() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"max_depht": 5})
    assert info.value.key == "max_depht"
    message = str(info.value)
    assert "unknown setting" in message
    for field in dataclasses.fields(DurableConfig):
        assert field.name in message


def test_unknown_non_string_key() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({5: "x"})
    assert info.value.key == "5"


def test_unknown_key_reported_even_with_good_keys() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"sync": True, "bogus": 1})
    assert info.value.key == "bogus"


def test_max_depth_disconnected_below_max_depth_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"max_depth": 100, "max_depth_disconnected": 99})
    assert info.value.key == "max_depth_disconnected"
    assert "max_depth" in info.value.problem
    assert "100" in info.value.problem and "99" in info.value.problem


def test_max_bytes_disconnected_below_max_bytes_rejected_unless_unlimited() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"max_bytes": 1000, "max_bytes_disconnected": 999})
    assert info.value.key == "max_bytes_disconnected"
    assert "max_bytes (1000)" in info.value.problem and "999" in info.value.problem
    assert DurableConfig.from_mapping({"max_bytes": 1000}).max_bytes_disconnected == 0, "0 = no limit: allowed"
    assert DurableConfig().max_bytes == DurableConfig().max_bytes_disconnected == 0


def test_max_depth_above_default_disconnected_limit_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"max_depth": 2_000_000})
    assert info.value.key == "max_depth_disconnected"


def test_equal_depths_accepted() -> None:
    config = DurableConfig.from_mapping({"max_depth": 50, "max_depth_disconnected": 50})
    assert config.max_depth_disconnected == 50


def test_overflow_lists_accepted_values() -> None:
    assert OVERFLOW_POLICIES == ("drop-oldest", "drop-newest")
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"overflow": "drop-all"})
    assert info.value.key == "overflow"
    assert "drop-oldest" in str(info.value)
    assert "drop-newest" in str(info.value)
    assert "'drop-all'" in str(info.value)


@pytest.mark.parametrize("policy", ["drop-oldest", "drop-newest"])
def test_overflow_accepted(policy: str) -> None:
    assert DurableConfig.from_mapping({"overflow": policy}).overflow == policy


def test_session_takeover_defaults_to_owner_only_and_names_the_choices() -> None:
    assert DurableConfig().session_takeover == "owner-only"
    assert DurableConfig.from_mapping({"session_takeover": "any-user"}).session_takeover == "any-user"
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"session_takeover": "anyone"})
    assert info.value.key == "session_takeover"
    assert "owner-only, any-user" in str(info.value) and "'anyone'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        DurableConfig(session_takeover="nope")  # type: ignore[arg-type]
    assert info.value.key == "session_takeover"


@pytest.mark.parametrize("raw", [["store", "x"], "store: x", 5])
def test_non_mapping_section_rejected(raw: Any) -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping(raw)
    assert info.value.key == "amqtt_durable.DurableSessionsPlugin"
    assert "mapping" in str(info.value)


def test_constructor_checks_ranges_too() -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig(pending_threshold=0)
    assert info.value.key == "pending_threshold"
    with pytest.raises(ConfigError) as info:
        DurableConfig(overflow="nope")  # type: ignore[arg-type]
    assert info.value.key == "overflow"
    with pytest.raises(ConfigError) as info:
        DurableConfig(store="")
    assert info.value.key == "store"


def test_config_error_message_format() -> None:
    error = ConfigError("max_depth", "must be at least 1, got 0")
    assert str(error) == "amqtt_durable config: 'max_depth': must be at least 1, got 0"
    assert error.key == "max_depth"
    assert error.problem == "must be at least 1, got 0"


def test_a_stream_takes_defaults_for_its_limits() -> None:
    config = DurableConfig.from_mapping({"streams": [{"filter": "telemetry/+"}]})
    assert config.streams == [StreamConfig("telemetry/+", max_count=100_000, max_age=0.0)]


@pytest.mark.parametrize(
    ("streams", "key", "words"),
    [
        ([5], "streams[0]", "expected a mapping"),
        ([{"max_count": 5}], "streams[0].filter", "missing"),
        ([{"filter": "a/#", "size": 5}], "streams[0].size", "unknown setting"),
        ([{"filter": "a/#/b"}], "streams[0].filter", "not a valid topic filter"),
        ([{"filter": "$SYS/#"}], "streams[0].filter", "not a valid topic filter"),
        ([{"filter": "_durable/v1/ctl"}], "streams[0].filter", "not a valid topic filter"),
        ([{"filter": ""}], "streams[0].filter", "non-empty topic filter"),
        ([{"filter": "a"}, {"filter": "a"}], "streams[1].filter", "listed twice"),
        ([{"filter": "a", "max_count": 0}], "streams[0].max_count", "at least 1"),
        ([{"filter": "a", "max_count": "10"}], "streams[0].max_count", "whole number"),
        ([{"filter": "a", "max_age": -1}], "streams[0].max_age", "0 or more"),
        ([{"filter": "a", "max_age": math.inf}], "streams[0].max_age", "finite"),
    ],
)
def test_bad_stream_entries_name_the_entry_and_field(streams: list[Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        DurableConfig.from_mapping({"streams": streams})
    assert info.value.key == key
    assert words in str(info.value)


def test_a_number_read_as_written_shows_as_yaml_gave_it_and_safe_dumps_as_a_float() -> None:
    """settings.WrittenFloat: shown about as written (YAML gives the value: 1.50 shows as 1.5), and
    yaml.safe_dump writes it as a plain float."""
    written = yaml.safe_load("a: -1\nb: 1.50\n")
    assert [repr(WrittenFloat(value)) for value in written.values()] == ["-1", "1.5"]
    assert yaml.safe_load(yaml.safe_dump({"a": WrittenFloat(-1)})) == {"a": -1.0}
    assert isinstance(yaml.safe_load(yaml.safe_dump({"a": WrittenFloat(-1)}))["a"], float)


HUGE = 10**5000  # its repr raises Python's own ValueError (past 4300 digits)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"max_depth": HUGE}, "max_depth"),
        ({"sync": -HUGE}, "sync"),
        ({"overflow": [HUGE]}, "overflow[0]"),
        ({"streams": [{"filter": "t/#", "max_count": HUGE}]}, "streams[0].max_count"),
        ({"replication": {"role": "primary", "ack_timeout": HUGE}}, "replication.ack_timeout"),
        ({"replication": {"role": "primary", "mode": {"x": HUGE}}}, "replication.mode.x"),
    ],
)
def test_an_int_of_too_many_digits_given_in_python_names_its_setting(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        DurableConfig.from_mapping(raw)
    assert caught.value.key == key
    assert caught.value.problem == "an integer of more than 4300 digits"


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({HUGE: 1}, "amqtt_durable.DurableSessionsPlugin"),
        ({"replication": {"role": "primary", HUGE: 1}}, "replication"),
        ({"streams": [{HUGE: 1}]}, "streams[0]"),
    ],
)
def test_a_key_that_is_an_int_of_too_many_digits_names_its_mapping(raw: dict[Any, Any], key: str) -> None:
    """Naming such a key in a message raised Python's own ValueError."""
    with pytest.raises(ConfigError) as caught:
        DurableConfig.from_mapping(raw)
    assert caught.value.key == key
    assert caught.value.problem == "a key that is an integer of more than 4300 digits"


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: DurableConfig(max_depth=HUGE), "max_depth"),
        (lambda: DurableConfig(streams=[StreamConfig("t/#", max_count=HUGE)]), "streams[0].max_count"),
        (lambda: ReplicationConfig(role="primary", ack_timeout=HUGE), "replication.ack_timeout"),
    ],
)
def test_an_int_of_too_many_digits_in_a_config_made_in_python_names_its_setting(make: Any, key: str) -> None:
    with pytest.raises(ConfigError, match="an integer of more than 4300 digits") as caught:
        make()
    assert caught.value.key == key


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (300.0, "300"),
        (1e20, "100000000000000000000"),
        (0.5, "0.5"),
        (1 / 3, "0.3333333333333333"),
        (2.0**60, str(2**60)),
    ],
)
def test_seconds_text_writes_a_whole_number_in_all_its_digits_and_another_in_its_shortest_exact_text(
    seconds: float, shown: str
) -> None:
    """seconds_text (guarantees.md, the expiry WARNING): a whole number in all its digits, not the shortest
    text (1e+20); another in the shortest text that reads back as the same float."""
    assert seconds_text(seconds) == shown
    assert float(shown) == seconds
