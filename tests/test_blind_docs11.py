"""An eleventh pass of black-box tests written from README.md, docs/sdk.md, docs/streams.md and
docs/guarantees.md alone, and from the docstrings of the examples the README names: promises earlier
rounds left open. Real broker processes on 127.0.0.1 (ephemeral ports, tmp stores), raw sockets, paho and
SDK clients; each test quotes the promise it checks.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import WAIT, Broker

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=4 * WAIT, check=False, cwd=ROOT
    )


# ------------------------------------------------------------------------------- README: the examples


def test_dashboard_back_after_a_restart_gets_no_retained_initial_values_and_an_empty_cache_at_the_marker(
    broker_factory: Callable[..., Broker],
) -> None:
    """README: "examples/dashboard.py: replayed vs live readings and the last-value cache (SDK)"; its
    docstring, step 4: the dashboard back with the same client id finds its subscription in the broker's
    session, so (sdk.md) "a restarted client re-sends only the subscriptions its broker session lacks (a
    repeated SUBSCRIBE would queue retained values again)": no retained initial values come again, the
    replayed readings do not enter the cache, so it is empty at the marker until live readings arrive."""
    broker = broker_factory()
    result = run_script(ROOT / "examples" / "dashboard.py", "--port", str(broker.port), "--readings", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "marker (on_live) after 6 replayed events: 6 readings + 0 retained initial values" in out, out
    at_marker = out.split("back (session_present=1)", 1)[1].split("cache at the marker:", 1)[1]
    assert at_marker.splitlines()[2].strip() == "(empty)", out
    doc = (ROOT / "examples" / "dashboard.py").read_text().split('"""')[1]
    assert "sends the retained readings again" not in doc, "the docstring promises initial values again"
