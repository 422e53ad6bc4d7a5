"""A sixteenth pass of black-box tests written from docs/configuration.md, docs/operations.md, the
shipped broker.yaml's comments and docs/protocol.md alone, for promises the earlier test_blind_* and
test_docs_promises* files leave out: how ``amqtt-durable broker`` reads numbers YAML writes in
forms of its own (a float no float holds, an exponent without a point). The commands that end
without serving run in this process (test_blind_docs12's run_here); each test quotes the promise it
checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_blind_docs12 import refused_config

pytestmark = pytest.mark.timeout(60)

TOO_LARGE = "'session_expiry': must be a finite number, got a number too large for one"


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("session_expiry: 1.0e+400", TOO_LARGE),
        ("session_expiry: 1" + "0" * 400 + ".5", TOO_LARGE),
        (
            "replication: {role: primary, ack_timeout: 1.0e+999}",
            "'replication.ack_timeout': must be a finite number, got a number too large for one",
        ),
        ("max_depth: 1.0e+400", "'max_depth': expected a whole number, got 1.0e+400"),
        ("session_expiry: .inf", "'session_expiry': must be a finite number, 0 or more, got inf"),
    ],
)
def test_a_yaml_number_too_large_for_a_float_is_refused_as_in_python(tmp_path: Path, line: str, error: str) -> None:
    """configuration.md: a *number* setting "holds it as a float (... one too large for a float is refused
    with `'session_expiry': must be a finite number, got a number too large for one` ...)", and settings
    are "checked by these same rules" in broker.yaml and in Python. PyYAML reads a float written finite
    that no float holds (`1.0e+400`) as inf, which was refused as `got inf`, a value the file does not
    hold; a whole-number setting quoted it as `inf` too. `.inf`, written infinite, is still `got inf`."""
    assert error in refused_config(tmp_path, line)


def test_an_exponent_yaml_reads_as_text(tmp_path: Path) -> None:
    """configuration.md: "broker.yaml's YAML (1.1) reads an exponent only with a point and a sign
    (`1.0e+3`): `1e3` and `1.0e3` are text, refused with `'session_expiry': expected a number, got
    '1e3'`"; `-1.0e+3` is the number -1000, refused by its range as written."""
    assert "'session_expiry': expected a number, got '1e3'" in refused_config(tmp_path, "session_expiry: 1e3")
    assert "'session_expiry': expected a number, got '1.0e3'" in refused_config(tmp_path, "session_expiry: 1.0e3")
    assert "'batch_delay_ms': must be a finite number, 0 or more, got -1000" in refused_config(
        tmp_path, "batch_delay_ms: -1.0e+3"
    )
