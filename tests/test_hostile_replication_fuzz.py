"""An attacker on the replication port of a real primary broker (the port its backups connect to),
while a real backup is in sync and a paho client publishes QoS 1 in sync mode.

Pinned cases first, one of each kind, each from its own 127.0.0.X address (the log's limit is per
address): garbage, frames cut short or reset half-way, a header announcing an absurd length, a
first frame of the wrong direction or of no known type, a damaged checksum, HELLOs of another
version, another store, the real backup's name, a name that is none, twice, or followed by junk,
ACKs of batches never sent or going backwards, many connections at once. Then a seeded fuzz of
mutated frames on the primary's address, then on the backup's own (which serves tools and answers
a HELLO with ERROR, not the primary), bounded by count, time and failed cases, which reports its
seed and each failed case's bytes. With replication.secret, the same junk before the handshake.
The promise under test (docs/replication.md, Limits and Protocol): the attacker's connection gets
an ERROR frame (a refused handshake, a HELLO of another version or of a name in use) or is closed
(anything else that does not decode), with a log line naming why; the broker goes on; the real
backup stays in sync; every publish gets its PUBACK; and the backup, promoted, serves exactly the
messages the client published, nothing lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from test_ha_brokers import BACKUP, SERVING, address, node, start, static_pair
from test_replication_secret import SECRET, wait_in_sync

from amqtt_durable.replication.framing import MAX_FRAME, MAX_PEER_FRAME, Frame, encode_frame, encode_seq
from amqtt_durable.replication.tool import ask
from conftest import WAIT, Broker, Client, connack_code, run_cli

pytestmark = pytest.mark.timeout(240)

SEED = 20_261_129
CASES = 1000
FUZZ_BOUND_S = 60.0
MAX_FAILED = 3
"""The fuzz stops after FUZZ_BOUND_S or MAX_FAILED failed cases, whichever first, so that a
regression is reported with its seed and cases well before pytest-timeout ends the test."""
CLOSE_BOUND_S = 8.0
"""A connection whose peer has sent everything and half-closed is ended by the primary once it
reads the EOF or a frame it refuses (its handshake timeout, 10 s, is for a peer that sends nothing
more without closing)."""
BAD_LOG = ("Traceback", "Unhandled exception", "exception was never retrieved")
BACKUP_STREAM = {Frame.SNAP_BEGIN, Frame.SNAP_CHUNK, Frame.SNAP_END, Frame.BATCH, Frame.IN_SYNC}
"""What a primary sends a peer it serves as a backup (a HELLO of this version, of a free name)."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    return encode_frame(kind, payload)


def hello(name: str = "fz", store_id: int = 0, seq: int = 0, version: int = 1, instance: int = 0) -> bytes:
    payload = struct.pack(">HQQI", version, store_id, seq, 0) + name.encode()
    return frame(Frame.HELLO, payload + (b"\x00" + struct.pack(">Q", instance) if instance else b""))


def parse(answer: bytes) -> list[tuple[int, bytes]] | str:
    """The frames of ``answer``, or what is wrong with it (a cut or damaged frame)."""
    frames, at = [], 0
    while at < len(answer):
        if len(answer) - at < 9:
            return f"{len(answer) - at} bytes after the last whole frame"
        kind, length = struct.unpack_from(">BI", answer, at)
        end = at + 5 + length
        if end + 4 > len(answer):
            return f"a frame of type {kind} cut at {len(answer) - at - 5} of {length} bytes"
        if zlib.crc32(answer[at:end]) != struct.unpack_from(">I", answer, end)[0]:
            return f"a frame of type {kind} whose checksum does not match"
        frames.append((kind, answer[at + 5 : end]))
        at = end + 4
    return frames


def outcome(answer: bytes) -> str:
    """ "closed" (nothing answered), "error" (one ERROR frame, then the end), "served" (a backup's
    frames), or what else the primary answered (a failure)."""
    frames = parse(answer)
    if isinstance(frames, str):
        return f"a damaged answer: {frames}"
    kinds = [kind for kind, _ in frames]
    if not kinds:
        return "closed"
    if kinds == [Frame.ERROR]:
        return "error"
    if kinds[0] == Frame.SNAP_BEGIN and set(kinds) <= BACKUP_STREAM:
        return "served"
    if kinds in ([Frame.STATUS], [Frame.PROMOTE]):  # a tool's question, answered without a secret
        return "answered"
    return f"an answer of frames {kinds}"


def attack(port: int, data: bytes, *, source: str = "127.0.0.1", reset: bool = False) -> tuple[str, bytes]:
    """Send ``data`` on a new connection from ``source`` and half-close it (or reset it): (what
    happened, the bytes answered); "hang" when the primary did not close CLOSE_BOUND_S after the EOF."""
    sock = socket.socket()
    with sock:
        sock.settimeout(CLOSE_BOUND_S)
        sock.bind((source, 0))
        try:
            sock.connect(("127.0.0.1", port))
        except OSError as exc:
            return f"no connection: {exc!r}", b""
        answer = b""
        try:
            sock.sendall(data)
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return "reset", b""
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the primary closed it already (a refused frame)
            pass
        deadline = time.monotonic() + CLOSE_BOUND_S
        while (remaining := deadline - time.monotonic()) > 0:  # bounded by the deadline
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                return "hang", answer
            except OSError:  # reset by the primary: an end
                return outcome(answer), answer
            if not chunk:
                return outcome(answer), answer
            answer += chunk
        return "hang", answer


def served_then(port: int, source: str, then: Callable[[int], bytes]) -> tuple[str, bytes]:
    """A HELLO of a new backup, the snapshot read up to its SNAP_END, then ``then(its batch)`` sent
    and the connection half-closed: (what the primary did after, what it sent after the SNAP_END)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(source, 0)) as sock:
        sock.sendall(hello("fz-acks"))
        received = b""
        while True:  # bounded by the socket timeout: the snapshot of a small store
            frames = parse(received)
            if not isinstance(frames, str) and frames and frames[-1][0] == Frame.SNAP_END:
                break
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed before the snapshot's end: {received[:200]!r}"
            received += chunk
        seq = struct.unpack_from(">Q", frames[-1][1])[0]
        sock.sendall(then(seq))
        sock.shutdown(socket.SHUT_WR)
        rest = b""
        while chunk := sock.recv(1 << 16):
            rest += chunk
    kinds = parse(rest)
    return ("closed" if not isinstance(kinds, str) and {k for k, _ in kinds} <= {Frame.IN_SYNC} else f"{kinds}"), rest


@dataclass(frozen=True)
class Pinned:
    """One attack of a kind: what the primary must answer and the words its log must hold."""

    data: bytes
    answer: str
    """"error" or "closed" (see ``outcome``)."""
    logged: str
    reset: bool = False


def pinned_cases() -> dict[str, Pinned]:
    damaged = bytearray(hello("fz-damaged"))
    damaged[8] ^= 0xFF
    return {
        "garbage": Pinned(bytes(range(7, 200)), "closed", "is larger than 65536"),
        "a frame cut short": Pinned(hello("fz-cut")[:11], "closed", "ended before its first frame"),
        "reset mid-frame": Pinned(hello("fz-reset")[:11], "reset", "ended before its first frame", reset=True),
        "just over the longest frame": Pinned(
            struct.pack(">BI", Frame.HELLO, MAX_PEER_FRAME + 1) + bytes(64), "closed", "length 65537 is larger"
        ),
        "just over MAX_FRAME": Pinned(
            struct.pack(">BI", Frame.HELLO, MAX_FRAME + 1), "closed", f"length {MAX_FRAME + 1} is larger"
        ),
        "2**32-1 bytes": Pinned(struct.pack(">BI", Frame.ACK, 2**32 - 1), "closed", "length 4294967295 is larger"),
        "a backup-bound frame first": Pinned(frame(Frame.BATCH, bytes(30)), "closed", "first frame is BATCH"),
        "SNAP_END first": Pinned(frame(Frame.SNAP_END, bytes(12)), "closed", "first frame is SNAP_END"),
        "an ACK first": Pinned(frame(Frame.ACK, encode_seq(1)), "closed", "first frame is ACK"),
        "no such frame type": Pinned(frame(99, b"x"), "closed", "unknown type 99"),
        "a damaged checksum": Pinned(bytes(damaged), "closed", "checksum mismatch"),
        "AUTH to a primary without a secret": Pinned(
            frame(Frame.AUTH, bytes(32)), "error", "the peer sent a replication secret but this node has none"
        ),
        "a HELLO of version 2": Pinned(
            hello("fz-v2", version=2), "error", "replication protocol version 2 not supported: this primary speaks 1"
        ),
        "a HELLO whose name is no name": Pinned(hello("a/b"), "closed", "the backup's name is no replication.name"),
        "a HELLO with the real backup's name": Pinned(
            hello("b", instance=0xFF << 56 | 7), "error", "refused backup name b"
        ),
    }


def served_cases(store_id_other: int) -> dict[str, tuple[bytes, str]]:
    """HELLOs the primary serves (a snapshot), then what ends them: (bytes, log words)."""
    junk = bytes(range(256))
    return {
        "a HELLO of another store": (hello("fz-store", store_id=store_id_other, seq=5), "not this primary's"),
        "a HELLO twice": (hello("fz-twice") + hello("fz-twice"), "unexpected HELLO from a backup"),
        "junk after a HELLO": (hello("fz-junk") + junk, "length 16909060 is larger than 65536"),
        "an ACK of a batch never sent": (
            hello("fz-never") + frame(Frame.ACK, encode_seq(10**12)),
            "ack of batch 1000000000000, only",
        ),
    }


def mutated(rng: random.Random) -> bytes:
    """A random case: valid frames of any kind and direction, mutated; or garbage."""
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 300))
    if kind == 1:  # an absurd or lying length
        length = rng.choice([MAX_PEER_FRAME + 1, MAX_FRAME, MAX_FRAME + 1, 2**31, 2**32 - 1, rng.randrange(1 << 20)])
        return struct.pack(">BI", rng.randrange(256), length) + rng.randbytes(rng.randrange(40))
    parts = []
    for _ in range(rng.randrange(1, 4)):
        choice = rng.randrange(6)
        if choice == 0:
            name = rng.choice(["fz-r", "b", "", "x" * 1100, "a+b", "\u00e9t\u00e9"])
            parts.append(hello(name, rng.choice([0, 1, 2**63]), rng.randrange(1000), rng.choice([1, 1, 0, 2, 65535])))
        elif choice == 1:
            parts.append(frame(Frame.ACK, encode_seq(rng.choice([0, 1, 2**64 - 1, rng.randrange(1000)]))))
        else:
            parts.append(frame(rng.randrange(13), rng.randbytes(rng.randrange(40))))
    data = bytearray(b"".join(parts))
    for _ in range(rng.randrange(3)):
        at = rng.randrange(len(data))
        how = rng.randrange(3)
        if how == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif how == 1:
            del data[at:]
        else:
            data[at:at] = rng.randbytes(rng.randrange(1, 6))
        if not data:
            data = bytearray(b"\x01")
    return bytes(data)


class Watch:
    """The real pair and the client, checked after each case: both brokers alive, the real backup
    in sync, and a QoS 1 publish acknowledged (sync mode: after the backup has it)."""

    def __init__(self, primary: Broker, backup: Broker, publisher: Client, secret: str | None = None) -> None:
        self.primary, self.backup, self.publisher, self.secret = primary, backup, publisher, secret
        self.published: list[bytes] = []

    def problem(self) -> str | None:
        for broker in (self.primary, self.backup):
            if not broker.running:
                return f"broker {broker.settings['replication']['name']} exited with {broker.exit_status}"
        status = asyncio.run(ask(address(self.primary), Frame.STATUS, self.secret.encode() if self.secret else None))
        real = [row for row in status["backups"] if row["name"] == "b"]
        if [row["state"] for row in real] != ["in_sync"]:
            return f"the real backup is not in sync: {real}"
        payload = b"m%05d" % len(self.published)
        try:
            self.publisher.publish("t/a", [payload])
        except AssertionError as exc:
            return f"a publish got no PUBACK: {exc}"
        self.published.append(payload)
        return None


def sources() -> Iterator[str]:
    """A 127.0.0.X address per pinned case: the log's refusal lines are limited per address."""
    for last in range(10, 250):
        yield f"127.0.0.{last}"


def fuzz(watch: Watch, target: Broker) -> tuple[list[str], int, float, Counter[str]]:
    """The seeded cases on ``target``'s replication address until CASES ran, MAX_FAILED failed or
    FUZZ_BOUND_S passed: (the failed cases, each with its number, ending and bytes; how many ran;
    seconds taken; how many ended each way). A backup's address serves no backup (it answers a
    HELLO with ERROR, not the primary); a PROMOTE is not sent to it (without a secret, a tool's
    PROMOTE is the operator's decision, and is obeyed)."""
    on_backup = target is watch.backup
    allowed = {"closed", "error", "answered", "reset"} | (set() if on_backup else {"served"})
    rng = random.Random(SEED)
    failed: list[str] = []
    ends: Counter[str] = Counter()
    started = time.monotonic()
    ran = 0
    while ran < CASES and len(failed) < MAX_FAILED and time.monotonic() - started < FUZZ_BOUND_S:
        data, reset = mutated(rng), rng.random() < 0.15
        ran += 1
        if on_backup and data[0] == Frame.PROMOTE:
            continue
        what, answer = attack(port_of(target), data, reset=reset)
        ends[what] += 1
        problem = None if what in allowed else f"answered {what}"
        problem = problem or watch.problem()
        if problem is not None:
            ending = "reset" if reset else "half-closed"
            failed.append(f"case {ran - 1} ({ending}) {problem}: {data.hex()} -> {answer[:200].hex()}")
    return failed, ran, time.monotonic() - started, ends


def assert_no_traceback(*brokers: Broker) -> None:
    for broker in brokers:
        bad = [line for line in broker.log().splitlines() if any(words in line for words in BAD_LOG)]
        assert not bad, "\n".join(bad) + "\n" + broker.log()[-8000:]


def served_to_the_end(primary: Broker, backup: Broker, clients: Callable[..., Client], published: list[bytes]) -> None:
    """The primary is lost: the backup, promoted, serves the durable subscriber exactly what was
    published (sync mode: each PUBACK waited for the backup), nothing lost, nothing twice."""
    primary.kill()
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    device = clients(backup.port, "device")
    assert device.session_present is True
    assert device.wait_for(lambda messages: len(messages) >= len(published)), "the queue did not come"
    assert [m.payload for m in device.messages] == published, f"seed {SEED}"


def logged(broker: Broker, source: str, words: str) -> bool:
    """Whether a line of the broker's log names the connection from ``source`` and holds ``words``."""
    named = (f"{source}:", f"{source} ")  # ADDRESS:PORT, or the address alone (a connection closed at once)
    return any(words in line and any(n in line for n in named) for line in broker.log().splitlines())


def paired(broker_factory: Callable[..., Broker], clients: Callable[..., Client], secret: str | None) -> Watch:
    """A primary and a backup in sync (sync mode), a durable subscriber away, a publisher."""
    if secret is None:
        primary, backup = static_pair(broker_factory)
    else:  # static_pair asks for STATUS without the secret
        primary = start(node(broker_factory, "p", role="primary", secret=secret), SERVING)
        backup = start(node(broker_factory, "b", role="backup", primary=address(primary), secret=secret), BACKUP)
        wait_in_sync(primary)
    device = clients(primary.port, "device")
    assert device.subscribe("t/#", 1) == [1]
    device.disconnect()
    watch = Watch(primary, backup, clients(primary.port, "publisher", clean_session=True), secret)
    assert watch.problem() is None  # one batch at least: a snapshot holds something
    return watch


def port_of(broker: Broker) -> int:
    return int(address(broker).rsplit(":", 1)[1])


def test_attacks_on_the_replication_port_are_refused_and_the_real_backup_loses_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    watch = paired(broker_factory, clients, None)
    primary, port, source = watch.primary, port_of(watch.primary), sources()

    for name, case in pinned_cases().items():
        peer = next(source)
        what, answer = attack(port, case.data, source=peer, reset=case.reset)
        assert what == case.answer, f"{name}: {what}: {answer[:200]!r}"
        assert primary.wait_until(lambda: logged(primary, peer, case.logged), WAIT), (  # noqa: B023 (waited here)
            f"{name}: no line names {case.logged!r}:\n{primary.log()[-4000:]}"
        )
        assert (problem := watch.problem()) is None, f"{name}: {problem}"

    for name, (data, words) in served_cases(0x5EED).items():
        peer = next(source)
        what, answer = attack(port, data, source=peer)
        assert what in ("served", "closed"), f"{name}: {what}: {answer[:200]!r}"
        assert primary.wait_until(lambda: logged(primary, peer, words), WAIT), (  # noqa: B023 (waited here)
            f"{name}: no line names {words!r}:\n{primary.log()[-4000:]}"
        )
        assert (problem := watch.problem()) is None, f"{name}: {problem}"

    peer = next(source)  # the snapshot's batch acknowledged, then the one before it
    what, _ = served_then(
        port, peer, lambda seq: frame(Frame.ACK, encode_seq(seq)) + frame(Frame.ACK, encode_seq(seq - 1))
    )
    assert what == "closed", what
    assert primary.wait_until(lambda: logged(primary, peer, "after an ack of batch"), WAIT), primary.log()[-4000:]
    assert (problem := watch.problem()) is None, f"an ACK going backwards: {problem}"

    peer = next(source)  # many connections at once from one address: 8 wait for their first frame, the rest are cut
    crowd = [socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(peer, 0)) for _ in range(40)]
    for sock in crowd:
        with contextlib.suppress(OSError):
            sock.sendall(hello("fz-crowd")[:7])
    assert primary.wait_until(lambda: logged(primary, peer, "at once"), WAIT), primary.log()[-4000:]
    for sock in crowd:
        sock.close()
    assert (problem := watch.problem()) is None, f"many connections: {problem}"

    for target, ways in ((primary, ("closed", "error", "served", "reset")), (watch.backup, ("closed", "error"))):
        failed, ran, fuzz_s, ends = fuzz(watch, target)
        assert not failed and ran == CASES, f"seed {SEED}: {ran} of {CASES} cases ran in {fuzz_s:.1f}s; " + "; ".join(
            failed
        )
        # The fuzz reaches past the first frame: some cases are served as a backup, some refused with an ERROR.
        assert all(ends[way] for way in ways), f"seed {SEED}: {ends}"
    assert_no_traceback(watch.primary, watch.backup)
    served_to_the_end(watch.primary, watch.backup, clients, watch.published)


def test_with_a_secret_junk_before_the_handshake_is_refused_without_a_traceback(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """With replication.secret nothing is served before the handshake: every case is refused with
    an ERROR frame or closed, the real backup stays in sync and the publishes get their PUBACKs."""
    watch = paired(broker_factory, clients, SECRET)
    primary, port, source = watch.primary, port_of(watch.primary), sources()
    cases = {
        "garbage": (bytes(range(7, 200)), "closed", "is larger than 256"),
        "a HELLO": (hello("fz"), "error", "authentication required"),
        "a HELLO of version 2": (hello("fz", version=2), "error", "authentication required"),
        "2**32-1 bytes": (struct.pack(">BI", Frame.AUTH, 2**32 - 1), "closed", "length 4294967295 is larger"),
        "a short nonce": (frame(Frame.AUTH, bytes(5)), "error", "malformed AUTH frame"),
        "a frame cut short": (frame(Frame.AUTH, bytes(32))[:20], "closed", "ended before its first frame"),
    }
    for name, (data, answer, words) in cases.items():
        peer = next(source)
        what, got = attack(port, data, source=peer)
        assert what == answer, f"{name}: {what}: {got[:200]!r}"
        assert primary.wait_until(lambda: logged(primary, peer, words), WAIT), (  # noqa: B023 (waited here)
            f"{name}: no line names {words!r}:\n{primary.log()[-4000:]}"
        )
        assert (problem := watch.problem()) is None, f"{name}: {problem}"
    rng = random.Random(SEED)
    for number in range(300):  # bounded: each case ends within CLOSE_BOUND_S
        data = mutated(rng)
        what, got = attack(port, data)
        assert what in ("closed", "error"), f"seed {SEED}, case {number}: {what}: {data.hex()} -> {got[:200].hex()}"
    assert (problem := watch.problem()) is None, problem
    assert_no_traceback(watch.primary, watch.backup)
