"""The README and docs/ pages: every link resolves and every block a user would copy is checked.

Python blocks compile (the README's SDK example is also run, by test_examples), broker.yaml
excerpts load through the plugin's own settings check, fleet schedules through the fleet's,
JSON parses, and every command a shell block names exists (`--help` of each console
subcommand, each make target, each example script).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from amqtt_durable.config import DurableConfig
from conftest import Broker, Client, payloads
from durable_fleet.model import HA_FAULT_KINDS
from durable_fleet.schedule import load_schedule

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN = "amqtt_durable.DurableSessionsPlugin"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        found += [(page.name, code) for lang, code in BLOCK.findall(page.read_text()) if lang == language]
    return found


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = BLOCK.sub("", page.read_text())
    titles = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(BLOCK.sub("", page.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = page if not path else (page.parent / path).resolve()
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: {broken}"


def test_python_blocks_compile() -> None:
    found = blocks("python")
    assert found, "the docs show Python"
    for name, code in found:
        compile(code, f"{name} (a python block)", "exec")


def plugin_settings(document: object) -> object:
    """The plugin's settings of a broker.yaml excerpt: a whole config, or the plugin's own lines."""
    if isinstance(document, dict) and "plugins" in document:
        return document["plugins"][PLUGIN]
    return document


def test_yaml_blocks_are_valid_broker_settings_or_fleet_schedules(tmp_path: Path) -> None:
    found = blocks("yaml")
    assert len(found) >= 3
    for name, code in found:
        document = yaml.safe_load(textwrap.dedent(code))
        if isinstance(document, dict) and "faults" in document:
            script = tmp_path / "schedule.yaml"
            script.write_text(code)
            devices = [f"dev-{i:03d}" for i in range(1, 21)]
            ha = any(fault.get("kind") in HA_FAULT_KINDS for fault in document["faults"])  # a --ha script
            assert load_schedule(script, devices=devices, duration=60.0, ha=ha), name
        else:
            DurableConfig.from_mapping(plugin_settings(document))  # raises, naming the key, if wrong


def test_json_blocks_parse() -> None:
    found = blocks("json")
    assert found, "the protocol page shows its messages"
    decoder = json.JSONDecoder()
    for name, code in found:  # one or more messages per block
        position, values = 0, 0
        while code[position:].strip():
            position += len(code[position:]) - len(code[position:].lstrip())
            value, position = decoder.raw_decode(code, position)
            assert isinstance(value, dict), f"{name}: a message is a JSON object"
            values += 1
        assert values, name


def shell_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for name, code in blocks("sh"):
        for line in code.splitlines():
            words = line.split("#", 1)[0].split()
            if words:
                commands.append((name, words))
    return commands


CONSOLE = {"amqtt-durable", "durable-pipeline"}


def test_the_readme_names_the_makefile_s_number_of_test_workers() -> None:
    """README: "All three run the tests in N processes": N is the Makefile's TEST_WORKERS default."""
    workers = re.search(r"^TEST_WORKERS \?= (\d+)$", (ROOT / "Makefile").read_text(), re.M)
    said = re.search(r"run the tests in (\w+) processes", " ".join((ROOT / "README.md").read_text().split()))
    assert workers and said
    words = ["one", "two", "three", "four", "five", "six"]
    assert said.group(1) == words[int(workers.group(1)) - 1], (said.group(0), workers.group(0))


@pytest.mark.parametrize(("page", "words"), shell_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_shell_commands_exist(page: str, words: list[str]) -> None:
    program = Path(words[0]).name
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert words[1] in targets, f"{page}: make {words[1]} is not a target"
    elif program in CONSOLE:
        command = Path(sys.executable).parent / program
        argv = [str(command), words[1], "--help"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, f"{page}: {' '.join(words[:2])} --help failed:\n{result.stderr}"
    elif program.startswith("python"):
        assert (ROOT / words[1]).is_file(), f"{page}: {words[1]} does not exist"
    elif program == "etcd":  # the coordinator of replication, which make setup installs
        assert shutil.which("etcd"), f"{page}: etcd is not installed"
    else:
        pytest.fail(f"{page}: a shell block names {program!r}, which this test does not know how to check")


def runtime_settings(spark: Any) -> dict[str, str]:
    """The session's settings a running session can change (not spark.app.name, spark.master, ...)."""
    return {key: value for key, value in spark.conf.getAll.items() if spark.conf.isModifiable(key)}


def restore_settings(spark: Any, before: dict[str, str]) -> None:
    """Put back the session's runtime settings as they were (``before``: its ``runtime_settings``). The page's
    get_session, given the running session, applies its own settings to it (spark.sql.shuffle.partitions 4
    instead of the test session's 1), which would otherwise stay for every later Spark test of this process."""
    after = runtime_settings(spark)
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        if key in before:
            spark.conf.set(key, before[key])
        else:
            spark.conf.unset(key)


@pytest.mark.slow  # Spark (the session's): a streaming query, seconds
# The suite's 120 s bounds this test's own work (the call), as for every other Spark test. By default it
# would also cover the fixtures' setup, and this test, when the first of its run to use the session-wide
# `spark` fixture (a run of this file), pays the start of its JVM there: 8-16 s in the suite's runs, 48 s to
# over 120 s on 2 cores with a load of 6-10, which used up the budget before or while the query ran (nothing
# here waits on a fixed time).
@pytest.mark.timeout(120, func_only=True)
def test_the_pipeline_page_streaming_example_runs(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], spark: Any, tmp_path: Path
) -> None:
    """The page's block, run in this process: its get_session() gets the test session's Spark (a fresh
    process with a JVM of its own runs the same streaming query in test_pipeline_demo). Its relative ./out is
    made absolute: Spark resolves relative paths from the JVM's working folder, not this process's."""
    (code,) = [c for n, c in blocks("python") if n == "pipeline.md"]
    assert '.option("port", 1883)' in code and "./out/events" in code
    broker = broker_factory(streams=[{"filter": "telemetry/#"}])
    publisher = clients(broker.port, "publisher", clean_session=True)
    publisher.publish("telemetry/a", payloads(20))
    code = code.replace('.option("port", 1883)', f'.option("port", {broker.port})')
    code = code.replace('"./out/', f'"{tmp_path}/out/')
    assert "./out" not in code
    namespace: dict[str, Any] = {}
    settings = runtime_settings(spark)
    try:
        exec(compile(code, "pipeline.md", "exec"), namespace)  # the page's own example
        query = namespace["query"]
        try:
            query.processAllAvailable()
        finally:
            query.stop()
    finally:
        restore_settings(spark, settings)
    assert namespace["spark"] is spark
    assert runtime_settings(spark) == settings, "the test session's settings, as before the page's get_session"
    assert spark.read.parquet(str(tmp_path / "out" / "events")).count() == 20, "every published event, once"
