"""Blind tests of README.md, docs/configuration.md and docs/pipeline.md, second pass: promises the other
test files did not check as a user meets them. Real brokers (conftest), real paho clients, the real CLI, and
real Spark in one driver of its own (tests/spark_retry_child.py): the page's default master is the point there,
so the suite's session-wide local[2] ``spark`` fixture cannot serve. Each test quotes the promise it checks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from test_docs import blocks

from conftest import WAIT, Broker, Client, free_port, payloads, run_cli
from durable_client import DurableClient

HERE = Path(__file__).resolve().parent
FILTER = "telemetry/#"
PLUGIN = "amqtt_durable.DurableSessionsPlugin"
BIG_PAYLOAD = 1_000_000
"""Bytes of one payload: its PUBLISH under the default max_packet_size, 1048576."""
DEFAULT_PENDING_BYTES = 16_777_216
"""configuration.md's default max_pending_bytes_clean (16 MiB)."""


# ------------------------------------------------------------------ pipeline.md: the example and task retries
@pytest.mark.slow
@pytest.mark.timeout(20 * WAIT)  # a JVM of its own (seconds; minutes on a loaded machine) and a query
def test_the_page_s_example_session_runs_a_read_task_that_got_nothing_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """pipeline.md: Spark "in local mode (the default of ... `get_session()`, `local[2,4]`: two cores, a failed
    task tried up to 4 times as on a cluster ...)" ("A process that already runs a SparkSession gets that one":
    this one runs none before the page's); "a task that gets nothing for `timeout` seconds fails and is run
    again, up to Spark's task retries". The page's own streaming example, run as a user runs it (a process of
    its own, its `get_session()`), reads through a proxy that keeps the first read task's stream silent (and
    forwards every later one): that task fails, its retry reads, and the query goes on and writes every event
    once (on `local[2]`, one try per task, the query fails)."""
    (code,) = [c for name, c in blocks("python") if name == "pipeline.md"]
    assert "get_session()" in code, "the example takes the default master"
    broker = broker_factory(streams=[{"filter": FILTER}])
    clients(broker.port, "blind2-pub", clean_session=True).publish("telemetry/a", payloads(30))
    code = code.replace('.option("port", 1883)', '.option("port", PROXY_PORT).option("timeout", 3)')
    code = code.replace('"./out/', f'"{tmp_path}/out/')
    assert "PROXY_PORT" in code and "./out" not in code
    example = tmp_path / "example.py"
    example.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(HERE / "spark_retry_child.py"), str(example), str(broker.port)],
        capture_output=True, text=True, timeout=18 * WAIT, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["master"] == "local[2,4]", outcome
    assert outcome["error"] is None and outcome["finished"], outcome
    assert outcome["silenced"] == 1 and outcome["forwarded"] >= 1, f"no read task was run again: {outcome}"
    assert outcome["ids"] == list(range(1, 31)), "every event once, after the retry"


# ------------------------------------------------------------------ configuration.md: streams and clean limits
@pytest.mark.timeout(60)
def test_a_stream_on_every_topic_logs_no_control_request_and_no_sys_topic(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """configuration.md, `streams`: "`filter` a valid filter outside `$` and `_durable/`": `#` is such a filter
    (MQTT's `#` matches no `$` topic), and the SDK's control requests (`_durable/v1/ctl`) and the broker's
    `$SYS/broker/durable/` metrics it would otherwise match get no log; what a client publishes does."""
    broker = broker_factory(streams=[{"filter": "#"}], metrics_interval=0.05)
    watcher = clients(broker.port, "blind2-sys", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    assert watcher.wait_messages(1), "metrics are published"
    client = sdk(broker.port, "blind2-all", durable_session=False)
    client.connect()  # its hello is a control request
    clients(broker.port, "blind2-pub", clean_session=True).publish("plain/a", payloads(2))
    info = client.stream_info("#")
    assert dict(info) == {"plain/a": (1, 2)}, info


@pytest.mark.timeout(60)
def test_max_pending_clean_and_its_byte_limit_0_are_no_limit(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md: `max_pending_clean` "Messages waiting to be sent to one clean-session connection (... a
    QoS 1/2 one waits until acknowledged ...): past it a new message for that connection is dropped, counted in
    `$SYS/broker/durable/messages/dropped_clean` ... 0 means no limit", and `max_pending_bytes_clean` (default
    `16777216`) "The same limit in payload bytes ... 0 means no limit": a clean subscriber that acknowledges
    nothing gets every one of 20 publishes of 1,000,000 bytes (20 MB, past the 16 MiB a 0 taken for the default
    would allow; each under the default `max_packet_size`), and nothing is counted dropped. (The count's own
    default, 10000 messages, is not reached here: this shows its 0 accepted, not told apart from the default.)"""
    broker = broker_factory(max_pending_clean=0, max_pending_bytes_clean=0, metrics_interval=0.05)
    slow = clients(broker.port, "blind2-slow", clean_session=True, manual_ack=True)
    slow.subscribe("pend/#", 1)
    sent = [bytes([65 + i]) * BIG_PAYLOAD for i in range(20)]
    assert sum(map(len, sent)) > DEFAULT_PENDING_BYTES
    clients(broker.port, "blind2-pend-pub", clean_session=True).publish("pend/a", sent)
    assert [m.payload for m in slow.wait_messages(20)] == sent, "every message, none acknowledged"
    watcher = clients(broker.port, "blind2-pend-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/messages/dropped_clean", 0)
    assert watcher.wait_for(bool), "the counter is published"
    assert {m.payload for m in watcher.messages} == {b"0"}


# ------------------------------------------------------------------ configuration.md: keys named by their path
SETTINGS = "expected a mapping of settings"
PLUGIN_ITEM = "expected a plugin name or a mapping of a plugin to its settings"


@pytest.mark.parametrize(
    ("plugins", "named", "expected"),
    [
        ({PLUGIN: 5}, f"plugins.{PLUGIN}", SETTINGS),
        ([{"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}, {PLUGIN: ["store"]}],
         f"plugins[1].{PLUGIN}", SETTINGS),
        ({PLUGIN: 0}, f"plugins.{PLUGIN}", SETTINGS),  # falsy, yet no empty mapping of settings
        ({PLUGIN: []}, f"plugins.{PLUGIN}", SETTINGS),
        ({PLUGIN: False}, f"plugins.{PLUGIN}", SETTINGS),
        ([{PLUGIN: ""}], f"plugins[0].{PLUGIN}", SETTINGS),
        ([{"amqtt.plugins.authentication.AnonymousAuthPlugin": None}, [PLUGIN]], "plugins[1]", PLUGIN_ITEM),
    ],
    ids=["mapping", "list", "zero", "empty-list", "false", "empty-string", "list-in-list"],
)
@pytest.mark.timeout(60)
def test_a_plugin_entry_that_is_not_a_mapping_of_settings_is_named_by_its_path(
    tmp_path: Path, plugins: object, named: str, expected: str
) -> None:
    """configuration.md: a wrong type "stops the broker with an error that names the key (exit code 2): a setting
    of the plugin as the table names it (`store`, ...), any other key by its path from the top of the file
    (`listeners.default.bind`)", as `plugins[1].amqtt_durable.DurableSessionsPlugin` names the plugin's entry in a
    `plugins:` list. The plugin's entry is no setting of its own: anything there but its settings or nothing
    (a number, a list, `false`, `""`, 0) is named by its path, in either form of `plugins:`; so is an item of a
    `plugins:` list that is neither a plugin's name nor a mapping (a list)."""
    config = {"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{free_port()}"}}, "plugins": plugins}
    (tmp_path / "broker.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = run_cli("broker", "-c", "broker.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"'{named}': {expected}" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "data").exists(), "no store made"
