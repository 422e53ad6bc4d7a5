"""Issue 11, points 2 and 5: each package imports alone, loads nothing above it, and no import
cycle joins our packages (the plugin once imported the fleet harness, which imports the plugin;
and loaded paho-mqtt through the SDK for the wire protocol)."""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
OURS = frozenset(PACKAGE_DIRS)
TIMEOUT = 120.0

# Each package and the first-party packages it may import (anywhere in its code, lazily too).
ALLOWED: dict[str, frozenset[str]] = {
    "durable_protocol": frozenset(),
    "amqtt_durable": frozenset({"durable_protocol"}),
    "durable_client": frozenset({"durable_protocol"}),
    "durable_pipeline": frozenset({"durable_protocol", "durable_client", "amqtt_durable"}),
    "durable_fleet": frozenset({"durable_protocol", "durable_client", "amqtt_durable", "durable_pipeline"}),
}

# What importing the package and every one of its modules must not load.
FORBIDDEN: dict[str, frozenset[str]] = {
    "durable_protocol": OURS - {"durable_protocol"} | {"paho", "amqtt", "plyvel", "yaml"},
    "amqtt_durable": frozenset(
        {"paho", "durable_client", "durable_pipeline", "durable_fleet", "pyspark", "matplotlib"}
    ),
    "durable_client": frozenset({"amqtt", "amqtt_durable", "plyvel", "durable_pipeline", "durable_fleet", "pyspark"}),
    "durable_pipeline": frozenset({"durable_fleet"}),
    "durable_fleet": frozenset(),
}

LOAD_ALL = """
import importlib, json, pkgutil, sys
name = sys.argv[1]
package = importlib.import_module(name)
modules = [name, *(info.name for info in pkgutil.walk_packages(package.__path__, name + "."))]
for module in modules:
    importlib.import_module(module)
print(json.dumps({"modules": modules, "loaded": sorted(sys.modules)}))
"""


def loaded_by(*argv: str) -> dict[str, list[str]]:
    """Top-level modules a fresh interpreter has loaded after ``LOAD_ALL`` (or other code) ran."""
    done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result: dict[str, list[str]] = json.loads(done.stdout.splitlines()[-1])
    return result


def top_level(modules: list[str]) -> set[str]:
    return {name.partition(".")[0] for name in modules}


def test_every_shipped_package_is_covered() -> None:
    """A package added to the distribution gets its rules here (and py.typed, mypy, isort)."""
    assert set(ALLOWED) == set(FORBIDDEN) == OURS
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert sorted(setuptools["packages"]) == sorted(OURS)
    for name, folder in PACKAGE_DIRS.items():
        assert (ROOT / folder / "py.typed").is_file(), folder
        assert setuptools["package-data"][name] == ["py.typed"], name
        assert folder in PYPROJECT["tool"]["mypy"]["files"], folder
        assert name in PYPROJECT["tool"]["ruff"]["lint"]["isort"]["known-first-party"], name


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_alone_without_what_is_above_it(package: str) -> None:
    result = loaded_by(LOAD_ALL, package)
    assert len(result["modules"]) > 1 or package == "durable_protocol", result["modules"]
    loaded = top_level(result["loaded"])
    assert not loaded & FORBIDDEN[package], f"importing {package} loaded {sorted(loaded & FORBIDDEN[package])}"
    assert loaded & OURS <= ALLOWED[package] | {package}, sorted(loaded & OURS)


def test_protocol_needs_only_the_standard_library() -> None:
    at_start = top_level(loaded_by("import json, sys; print(json.dumps({'loaded': sorted(sys.modules)}))")["loaded"])
    loaded = top_level(loaded_by(LOAD_ALL, "durable_protocol")["loaded"]) - at_start  # site hooks load a few
    assert loaded - set(sys.stdlib_module_names) == {"durable_protocol"}


def test_sdk_protocol_module_is_the_shared_protocol() -> None:
    """``durable_client.protocol`` stays importable for SDK users: the same objects, every public name."""
    code = """
import json, durable_client.protocol as sdk, durable_protocol as shared
defined = [n for n, v in vars(shared).items() if not n.startswith("_") and (n.isupper() or
           getattr(v, "__module__", None) == "durable_protocol")]
print(json.dumps({"unlisted": sorted(set(defined) - set(shared.__all__)),
                  "not_shared": [n for n in shared.__all__ if getattr(sdk, n, None) is not getattr(shared, n)],
                  "same_all": sorted(sdk.__all__) == sorted(shared.__all__)}))
"""
    assert loaded_by(code) == {"unlisted": [], "not_shared": [], "same_all": True}


def test_console_command_loads_neither_fleet_nor_spark_for_the_broker() -> None:
    """``amqtt-durable broker`` starts without the pipeline extra: the fleet is loaded only for ``fleet``."""
    loaded = loaded_by("import durable_fleet.console, json, sys; print(json.dumps({'loaded': sorted(sys.modules)}))")
    assert not {"durable_fleet.cli", "durable_fleet.runner", "durable_pipeline"} & set(loaded["loaded"])
    assert not {"pyspark", "matplotlib", "paho"} & top_level(loaded["loaded"])


def test_the_store_tools_start_without_amqtt_and_the_plugin_loads_by_its_path() -> None:
    """inspect, repair and promote load no amqtt (0.3 s of a 0.6 s run: the suite runs them some 190 times);
    broker.yaml's ``amqtt_durable.DurableSessionsPlugin`` still loads through amqtt's own import_string."""
    loaded = loaded_by("import durable_fleet.console, json, sys; print(json.dumps({'loaded': sorted(sys.modules)}))")
    assert not {"amqtt", "amqtt_durable.amqtt_glue"} & (set(loaded["loaded"]) | top_level(loaded["loaded"]))
    code = """
import json, amqtt_durable
from amqtt.utils import import_string
from amqtt_durable.amqtt_glue import DurableSessionsPlugin
print(json.dumps({"same": import_string("amqtt_durable.DurableSessionsPlugin") is DurableSessionsPlugin
                  is amqtt_durable.DurableSessionsPlugin, "listed": "DurableSessionsPlugin" in amqtt_durable.__all__}))
"""
    assert loaded_by(code) == {"same": True, "listed": True}
    unloaded = "import json, amqtt_durable; print(json.dumps({'dir': 'DurableSessionsPlugin' in dir(amqtt_durable)}))"
    assert loaded_by(unloaded) == {"dir": True}  # listed before it is loaded


def imports_of(package: str) -> set[str]:
    """First-party packages imported anywhere in a package's source (function-level imports too)."""
    found: set[str] = set()
    for path in (ROOT / PACKAGE_DIRS[package]).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return (found & OURS) - {package}


def test_no_import_cycle_between_our_packages() -> None:
    graph = {package: imports_of(package) for package in sorted(OURS)}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("durable_protocol") < order.index("amqtt_durable") < order.index("durable_fleet")
    for package, uses in graph.items():
        assert uses <= ALLOWED[package], f"{package} imports {sorted(uses - ALLOWED[package])}, above it"


def run_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=TIMEOUT, check=False,
                          cwd=ROOT)


def test_console_script_dispatches_every_documented_command() -> None:
    """The entry point pyproject installs as ``amqtt-durable``, run as pip's script runs it."""
    module, _, function = PYPROJECT["project"]["scripts"]["amqtt-durable"].partition(":")
    script = f"import sys; sys.argv[0] = 'amqtt-durable'; from {module} import {function}; sys.exit({function}())"
    top = run_command("-c", script, "--help")
    assert top.returncode == 0, top.stderr
    assert "{broker,inspect,promote,repair,fleet}" in top.stdout
    promote = run_command("-c", script, "promote", "--help")
    assert promote.returncode == 0 and "replication.listen" in promote.stdout, promote.stderr
    fleet = run_command("-c", script, "fleet", "--help")
    assert fleet.returncode == 0, fleet.stderr
    assert fleet.stdout.startswith("usage: amqtt-durable fleet") and "--devices" in fleet.stdout
    broker = run_command("-c", script, "broker", "--help")
    assert broker.returncode == 0 and "--config" in broker.stdout, broker.stderr
    bad = run_command("-c", script, "inspect", str(ROOT / "no-such-store"))
    assert bad.returncode == 1 and bad.stderr.startswith("amqtt-durable: "), bad.stderr


def test_broker_still_starts_as_a_plugin_module() -> None:
    """Tests, benchmarks, the fleet and process.py start the broker as ``python -m amqtt_durable.cli broker``."""
    done = run_command("-m", "amqtt_durable.cli", "broker", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: amqtt-durable broker") and "--config" in done.stdout
