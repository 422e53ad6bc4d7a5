"""A real etcd for the tests: Debian's etcd-server (``make setup`` installs it), one member on
127.0.0.1 ephemeral client and peer ports, a data dir in the test's tmp folder, ended by PID.

Registered as a pytest plugin by tests/conftest.py (``pytest_plugins``): a test asks for the
``etcd`` fixture.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from amqtt_durable.process import HOST, ChildProcess, free_port

READY_WAIT = 20.0


class Etcd(ChildProcess):
    """One etcd member. Short heartbeat and election timeouts: it elects itself in a fraction
    of a second, and the shortest lease it grants is about one second."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd is not installed: run 'make setup' (apt-get install etcd-server)")
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://{HOST}:{self.client_port}"
        peer = f"http://{HOST}:{self.peer_port}"
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(
            [
                binary,
                "--name", "test",
                "--data-dir", str(folder / "data"),
                "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}",
                "--heartbeat-interval", "50",
                "--election-timeout", "500",
            ],
            folder / "etcd.log",
            wait=10.0,
        )  # fmt: skip

    def ready(self) -> bool:
        """The member answers a read through the v3 gateway (it has a leader)."""
        request = urllib.request.Request(f"{self.url}/v3/kv/range", data=json.dumps({"key": "eA=="}).encode())
        try:
            with urllib.request.urlopen(request, timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def start(self) -> Etcd:
        super().start()
        if not self.wait_until(self.ready, READY_WAIT):
            self.kill()
            pytest.fail(f"etcd did not become ready in {READY_WAIT} s; see {self.log_path}")
        return self


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()
