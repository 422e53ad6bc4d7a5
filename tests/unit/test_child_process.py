"""ChildProcess.await_ready: the two ways a child fails to come up, with real child processes;
ChildProcess.start's holding of SIGTERM/SIGINT while it spawns (real signals, sent by the child
before its exec); BrokerProcess: a broker stopped while it starts is SIGKILLed after its stop wait;
EtcdProcess: stopped when its start is interrupted, and ending with the process that started it;
free_port: its ports outside the kernel's ephemeral range, each parallel test worker's block of
them, and the cursor that hands them out in turn."""

from __future__ import annotations

import contextlib
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from amqtt_durable.process import (
    PORT_FLOOR,
    PORT_SLICE_ENV,
    BrokerProcess,
    ChildExitedError,
    ChildProcess,
    EtcdProcess,
    PortCursor,
    _parent_death_signal,
    _random_stride,
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


@contextlib.contextmanager
def handlers(new: dict[int, Callable[[int, FrameType | None], object] | signal.Handlers]) -> Iterator[None]:
    """``new``'s signal handlers for the block, the previous ones back after it."""
    before = {signum: signal.signal(signum, handler) for signum, handler in new.items()}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def signals_parent(*signums: int) -> Callable[[], None]:
    """A preexec_fn: the child, between its fork and its exec, sends its parent (us) ``signums``."""
    return lambda: [os.kill(os.getppid(), signum) for signum in signums] and None


def exits(signum: int, _frame: FrameType | None) -> None:
    sys.exit(f"stopped by signal {signum}")


def test_a_stop_signal_during_the_spawn_unwinds_only_once_the_child_is_kept(tmp_path: Path) -> None:
    """SIGTERM (a handler that exits, as ``amqtt-durable fleet``'s) arrives while Popen waits for the
    child's exec: start still keeps the running child's handle, then raises SystemExit; the handler
    is ours again afterwards. (Without the hold, SystemExit unwinds from inside Popen: no handle.)"""
    sleeper = shutil.which("sleep")
    assert sleeper is not None
    child = ChildProcess([sleeper, "60"], tmp_path / "child.log", wait=5.0,
                         preexec_fn=signals_parent(signal.SIGTERM))
    with handlers({signal.SIGTERM: exits}):
        with pytest.raises(SystemExit, match="stopped by signal 15"):
            child.start()
        assert signal.getsignal(signal.SIGTERM) is exits
    try:
        assert child.proc is not None and child.running
    finally:
        if child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(5.0)


def test_every_stop_signal_noted_during_the_spawn_is_raised_again(tmp_path: Path) -> None:
    """SIGTERM and SIGINT both during the spawn: both handlers run afterwards, even though the first
    one to run raises (each raises SystemExit here)."""
    seen: list[int] = []

    def note_and_exit(signum: int, _frame: FrameType | None) -> None:
        seen.append(signum)
        sys.exit(signum)

    child = python_child(tmp_path, "pass")
    child.preexec_fn = signals_parent(signal.SIGTERM, signal.SIGINT)
    with handlers({signal.SIGTERM: note_and_exit, signal.SIGINT: note_and_exit}), pytest.raises(SystemExit):
        child.start()
    assert child.proc is not None
    child.proc.wait(5.0)
    assert sorted(seen) == [signal.SIGINT, signal.SIGTERM], seen


def ignored_signals(pid: int) -> int:
    """The SigIgn mask of ``pid`` (Linux's /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn line for pid {pid}")


def test_a_child_inherits_an_ignored_sigint(tmp_path: Path) -> None:
    """A harness started with SIGINT ignored (``cmd &`` in a script): its children ignore it too;
    holding the signal over the spawn must not replace SIG_IGN by a handler that exec resets."""
    sleeper = shutil.which("sleep")
    assert sleeper is not None
    child = ChildProcess([sleeper, "60"], tmp_path / "child.log", wait=5.0)
    with handlers({signal.SIGINT: signal.SIG_IGN}):
        child.start()
    try:
        assert child.pid is not None
        pid = child.pid
        assert child.wait_until(lambda: os.readlink(f"/proc/{pid}/exe") == os.path.realpath(sleeper), 5.0)
        assert ignored_signals(pid) & (1 << (signal.SIGINT - 1)), "the child does not ignore SIGINT"
    finally:
        child.stop()


class SigtermDeafBroker(BrokerProcess):
    """A BrokerProcess (its start, its stop) whose command is a real process that ignores SIGTERM and
    never listens; SIGTERM's SystemExit (as ``amqtt-durable fleet``'s handler raises it) comes while
    it starts, once the process ignores SIGTERM."""

    def __init__(self, folder: Path, stop_wait: float) -> None:
        super().__init__({}, folder, free_port(), wait=stop_wait)  # ready_wait: its default, a minute
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
        self.argv = [sys.executable, "-c", code]
        self.interrupted: float | None = None

    def ready(self) -> bool:
        assert self.pid is not None
        if ignored_signals(self.pid) & (1 << (signal.SIGTERM - 1)):
            self.interrupted = time.monotonic()
            sys.exit(128 + signal.SIGTERM)
        return False


def test_a_broker_stopped_while_it_starts_is_sigkilled_after_its_stop_wait_not_its_start_wait(
    tmp_path: Path,
) -> None:
    """A broker caught by SIGTERM while it starts gets the stop's wait (here 1 s) after its SIGTERM
    before its SIGKILL, not its start's minute (before: one ``wait`` for both, the minute)."""
    broker = SigtermDeafBroker(tmp_path, stop_wait=1.0)
    assert broker.ready_wait == 60.0
    try:
        with pytest.raises(SystemExit):
            broker.start()
        assert broker.interrupted is not None
        took = time.monotonic() - broker.interrupted
        assert broker.exit_status == -signal.SIGKILL
        assert 0.9 <= took < 10, took
    finally:
        broker.kill()


def test_a_broker_start_gives_up_after_its_ready_wait_not_its_stop_wait(tmp_path: Path) -> None:
    """``ready_wait`` bounds the start (the fleet's broker: a minute) whatever the stop's ``wait`` (15 s):
    a start that used the stop's wait would give up after 0.2 s here."""
    broker = BrokerProcess({}, tmp_path, free_port(), ready_wait=1.5, wait=0.2)
    broker.argv = [sys.executable, "-c", "import time; time.sleep(30)"]  # never listens
    began = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"did not .* within 1.5 s"):
            broker.start()
        assert time.monotonic() - began >= 1.4
    finally:
        broker.kill()


def test_an_etcd_whose_start_is_interrupted_by_a_stop_signal_is_stopped(tmp_path: Path) -> None:
    """``EtcdProcess(folder).start()`` with SIGTERM during its spawn: the caller never gets the
    object, so start stops the member before SystemExit leaves it."""
    etcd = EtcdProcess(tmp_path / "etcd")
    first = etcd.preexec_fn

    def then_signal() -> None:
        if first is not None:
            first()
        os.kill(os.getppid(), signal.SIGTERM)

    etcd.preexec_fn = then_signal
    with handlers({signal.SIGTERM: exits}), pytest.raises(SystemExit):
        etcd.start()
    assert etcd.proc is not None and etcd.proc.poll() is not None, "etcd still runs"


def test_an_etcd_stops_by_itself_when_the_process_that_started_it_is_sigkilled(tmp_path: Path) -> None:
    """docs/fleet.md: "processes whose harness was killed outright notice it within a second and stop
    by themselves": etcd too (the kernel's parent-death signal)."""
    code = (
        "import pathlib, sys, time\n"
        "from amqtt_durable.process import EtcdProcess\n"
        f"etcd = EtcdProcess(pathlib.Path({str(tmp_path / 'etcd')!r})).start()\n"
        "print(etcd.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    harness = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout is not None
        line = harness.stdout.readline()  # bounded by the test's timeout; empty if the harness failed
        assert line.strip().isdigit(), f"the harness printed {line!r}"
        pid = int(line)
        ended = os.pidfd_open(pid)  # readable once etcd has ended
    finally:
        harness.kill()
        harness.wait(10.0)
    try:
        readable, _, _ = select.select([ended], [], [], 10.0)
        if not readable:
            signal.pidfd_send_signal(ended, signal.SIGKILL)  # the test failed: end the etcd it left
        assert readable, f"etcd (pid {pid}) outlived the SIGKILLed process that started it by 10 s"
    finally:
        os.close(ended)


def test_a_child_whose_parent_died_before_it_asked_for_the_parent_death_signal_never_execs() -> None:
    """The parent-death request in the child runs before exec, under the parent's Python handlers:
    a SIGTERM the child sends itself there would only set their flag and the program would run on,
    orphaned. Here the parent counts as gone (the recorded pid is not the child's parent); a
    Python SIGTERM handler is set, as the fleet's is."""
    ask = _parent_death_signal()
    if ask is None:
        pytest.skip("no prctl here")
    assert ask.__closure__ is not None
    ask.__closure__[ask.__code__.co_freevars.index("parent")].cell_contents = -1
    with handlers({signal.SIGTERM: exits}):
        child = subprocess.Popen(["sleep", "30"], preexec_fn=ask)  # noqa: PLW1509 - the very call under test
    try:
        assert child.wait(10.0) == 1, "the child ran its program although its parent counted as gone"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10.0)


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


def every_port_free(port: int, host: str) -> bool:
    """The cursors' order alone, whatever holds these ports on the machine now (the suite's own brokers
    draw from the same pool: a port one holds was passed over and the round went wrong)."""
    return True


def test_a_cursor_of_any_stride_that_shares_no_factor_hands_out_every_port_before_one_again() -> None:
    block = range(20000, 20012)
    for stride in (1, 5, 7, 11):
        cursor = PortCursor(block, start=3, stride=stride, free=every_port_free)
        first_round = [cursor.take() for _ in range(len(block))]
        assert sorted(first_round) == list(block), stride
        assert [cursor.take() for _ in range(len(block))] == first_round, stride
    with pytest.raises(ValueError, match="a stride of 4 would skip ports of a block of 12"):
        PortCursor(block, stride=4)


def test_two_cursors_that_meet_part_at_once() -> None:
    """Two runs of the suite side by side, their cursors at the same port: with one stride they went on
    together, each handing out the port the other had just given a broker still starting ("Address
    already in use"); free_port's random strides part them at the next port."""
    block = range(20000, 27500)
    strides = {_random_stride(len(block)) for _ in range(20)}
    assert len(strides) > 1 and all(math.gcd(stride, len(block)) == 1 for stride in strides)

    def side_by_side(one: int, other: int) -> list[bool]:
        ours, theirs = PortCursor(block, 100, one, every_port_free), PortCursor(block, 100, other, every_port_free)
        return [ours.take() == theirs.take() for _ in range(200)]

    assert all(side_by_side(1, 1)), "one stride for both: every port handed out twice at once"
    assert side_by_side(1, 2003) == [True] + [False] * 199
