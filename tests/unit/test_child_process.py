"""ChildProcess.await_ready: the two ways a child fails to come up, with real child processes;
free_port: its ports outside the kernel's ephemeral range, each parallel test worker's block of
them, and the cursor that hands them out in turn."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from amqtt_durable.process import (
    PORT_FLOOR,
    PORT_SLICE_ENV,
    ChildExitedError,
    ChildProcess,
    PortCursor,
    bindable,
    ephemeral_ports,
    free_port,
    port_block,
    port_pool,
)

pytestmark = pytest.mark.timeout(30)


def python_child(tmp_path: Path, code: str) -> ChildProcess:
    return ChildProcess([sys.executable, "-c", code], tmp_path / "child.log", wait=5.0)


def test_a_child_that_exits_while_awaited_names_its_status_and_log(tmp_path: Path) -> None:
    child = python_child(tmp_path, "raise SystemExit(3)").start()
    with pytest.raises(ChildExitedError, match=r"the tool exited with status 3; see .*child\.log"):
        child.await_ready("the tool", lambda: False, timeout=20.0, waiting_for="answer")


def test_a_child_never_ready_is_stopped_and_the_error_says_what_was_awaited(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import time; time.sleep(60)").start()
    with pytest.raises(RuntimeError, match=r"the tool did not answer within 0\.3 s; see .*child\.log"):
        child.await_ready("the tool", lambda: False, timeout=0.3, waiting_for="answer")
    assert not child.running


def test_a_ready_child_is_returned_running(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    child = python_child(tmp_path, code).start()
    try:
        assert child.await_ready("the tool", marker.exists, timeout=20.0, waiting_for="answer") is child
        assert child.running
    finally:
        child.stop()


def free_pair() -> range:
    """A block of two ports, both bindable a moment ago (free_port's, so no other worker's)."""
    first, second = sorted((free_port(), free_port()))
    return range(first, second + 1, second - first)


def test_free_port_never_hands_out_a_port_of_the_ephemeral_range() -> None:
    """Outgoing connections (and binds to port 0) take their local port from the ephemeral range:
    one could take a port handed out before the child binds it (errno 98 in the broker). Before,
    free_port handed out exactly such ports."""
    first, last = ephemeral_ports()
    ports = [free_port() for _ in range(200)]
    assert all(PORT_FLOOR <= port < 65536 and not first <= port <= last for port in ports), ports
    assert len(set(ports)) == len(ports), "each handed out once"


def test_the_pool_lies_below_the_ephemeral_range_or_else_above_it() -> None:
    assert port_pool((32768, 60999)) == range(PORT_FLOOR, 32768)  # Linux's default
    assert port_pool((49152, 65535)) == range(PORT_FLOOR, 49152)  # IANA's
    assert port_pool((PORT_FLOOR + 10, 60000)) == range(60001, 65536)  # too little below
    assert port_pool((1024, 65535)) == range(PORT_FLOOR, 65536)  # no room anywhere: no way to avoid it
    assert port_pool((PORT_FLOOR + 10, 65000)) == range(PORT_FLOOR, 65536)  # less than MIN_POOL either side
    assert port_pool((1024, 4999)) == range(PORT_FLOOR, 65536)  # all above


def test_the_blocks_of_the_slices_are_disjoint_and_cover_the_pool() -> None:
    pool = port_pool((32768, 60999))
    assert port_block(pool, None) == pool
    for count in range(1, 9):
        blocks = [port_block(pool, (index, count)) for index in range(count)]
        assert sum(len(block) for block in blocks) == len(pool)
        assert [block.start for block in blocks[1:]] == [block.stop for block in blocks[:-1]]  # consecutive
        assert blocks[0].start == pool.start and blocks[-1].stop == pool.stop
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(ValueError, match=f"{PORT_SLICE_ENV}=0/3: 2 ports cannot be cut into 3 blocks"):
        port_block(range(10, 12), (0, 3))


def test_free_port_hands_out_only_the_ports_of_its_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes with slices 0/3, 1/3 and 2/3 (three pytest-xdist workers) never get the same port."""
    pool = port_pool(ephemeral_ports())
    for index in range(3):
        monkeypatch.setenv(PORT_SLICE_ENV, f"{index}/3")
        block = port_block(pool, (index, 3))
        ports = [free_port() for _ in range(30)]
        assert all(port in block for port in ports), (block, ports)
    for wrong in ("2/2", "1", "a/2", "-1/2"):
        monkeypatch.setenv(PORT_SLICE_ENV, wrong)
        with pytest.raises(ValueError, match=f"{PORT_SLICE_ENV}=.*expected i/n"):
            free_port()


def test_the_cursor_hands_out_every_port_of_its_block_before_one_again() -> None:
    """A broker that stopped may start again on its port: a new broker must not be given it meanwhile."""
    block = free_pair()
    cursor = PortCursor(block, start=1)
    assert [cursor.take() for _ in range(5)] == [block[1], block[0], block[1], block[0], block[1]]


def test_a_port_someone_holds_is_passed_over_and_none_left_is_a_clear_error() -> None:
    block = free_pair()
    cursor = PortCursor(block)
    with socket.socket() as holder:  # bound, not even listening: a child's bind would fail
        holder.bind(("127.0.0.1", block[0]))
        assert [cursor.take(), cursor.take()] == [block[1], block[1]]
        with socket.create_server(("127.0.0.1", block[1])):
            pattern = rf"no free port on 127\.0\.0\.1 among the 2 ports {block[0]}-{block[1]}: every one is bound"
            with pytest.raises(RuntimeError, match=pattern):
                cursor.take()
    assert cursor.take() in block


def test_a_port_a_closed_connection_holds_in_time_wait_is_passed_over() -> None:
    """A server that sets no SO_REUSEADDR could not bind it (one that does, as asyncio's, could): not bindable."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)) as server, socket.create_connection(("127.0.0.1", port)) as peer:
        accepted, _ = server.accept()
        accepted.close()  # the server's end closes first: it is the one left in TIME_WAIT, on our port
        assert peer.recv(1) == b""
    assert not bindable(port)
    with socket.socket() as reuse:
        reuse.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reuse.bind(("127.0.0.1", port))
