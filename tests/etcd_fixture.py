"""A real etcd for the tests: Debian's etcd-server (``make setup`` installs it), one member on
127.0.0.1 client and peer ports from free_port, a data dir in the test's tmp folder, ended by PID
(``amqtt_durable.process.EtcdProcess``, which the fleet's HA runs use too).

Registered as a pytest plugin by tests/conftest.py (``pytest_plugins``): a test asks for the
``etcd`` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from amqtt_durable.process import EtcdProcess


def start_etcd(folder: Path) -> EtcdProcess:
    """A started member, or the test fails naming why (not installed, not ready: its log)."""
    try:
        return EtcdProcess(folder).start()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    server = start_etcd(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop()
