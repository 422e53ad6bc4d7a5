"""A real etcd for the tests: Debian's etcd-server (``make setup`` installs it), one member on
127.0.0.1 ephemeral client and peer ports, a data dir in the test's tmp folder, ended by PID.

Registered as a pytest plugin by tests/conftest.py (``pytest_plugins``): a test asks for the
``etcd`` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from amqtt_durable.process import EtcdProcess


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    try:
        server = EtcdProcess(tmp_path / "etcd").start_ready()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()
