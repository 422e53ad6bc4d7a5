"""How a replication address's gate logs what it turns away (review of fix-caps, findings 1-2):
the first event for each reason from each address in an interval is logged, at most
LOG_PER_HOST lines an address and LOG_HOSTS in all; the rest are summed up in one WARNING when
the interval ends (a timer, not the next event nor a stop), and the next interval logs each
address again. One address varying its frames (a reason may hold the peer's text) cannot take
every line. Real
connections (socket pairs) stand at the gate; the addresses are the gate's own keys. Each test's
events fall in one interval however slow the machine (LOG_EVERY is an hour): its summary comes
from abort_all, as at a stop, except where the timer itself is tested."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from amqtt_durable.admission import NameBudgets
from amqtt_durable.replication import gate
from amqtt_durable.replication.config import Network
from amqtt_durable.replication.gate import LOG_HOSTS, LOG_PER_HOST, HandshakeGate, allowed
from amqtt_durable.replication.primary import NAME_LOG_EVERY, REFUSED_NAMES

pytestmark = pytest.mark.timeout(30)

ONE_INTERVAL = 3600.0
"""LOG_EVERY while a test's events must fall in one interval (review of allow_from, finding 3: 60
admits had to fit in 0.3 s)."""
TIMER = 1.0
"""LOG_EVERY where the timer's summary is tested: two synchronous calls must fit in it."""
SUMMARY = "more connection(s) refused by the handshake"


class LogWaiter(logging.Handler):
    """The gate's WARNINGs, and a wait for one that matches."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self._arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self._arrived.set()

    async def wait_for(self, match: Callable[[str], bool], within: float = 5.0) -> str:
        async with asyncio.timeout(within):
            while True:
                found = [line for line in self.lines if match(line)]
                if found:
                    return found[0]
                self._arrived.clear()
                await self._arrived.wait()

    def naming(self, host: str) -> list[str]:
        return [line for line in self.lines if f"from {host}:" in line or f"from {host} " in line]


@asynccontextmanager
async def gate_logs(
    monkeypatch: pytest.MonkeyPatch, allow_from: tuple[Network, ...] | None = None
) -> AsyncIterator[tuple[HandshakeGate, LogWaiter]]:
    monkeypatch.setattr(gate, "LOG_EVERY", ONE_INTERVAL)
    waiter = LogWaiter()
    logger = logging.getLogger("amqtt_durable.replication")
    logger.addHandler(waiter)
    try:
        yield HandshakeGate("the test's address", per_host=2, total=1000, allow_from=allow_from), waiter
    finally:
        logger.removeHandler(waiter)


async def connection() -> tuple[asyncio.StreamWriter, socket.socket]:
    ours, theirs = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=ours)
    return writer, theirs


async def refuse(handshakes: HandshakeGate, host: str, why: str) -> None:
    """A connection from ``host`` admitted, then refused by its handshake."""
    writer, other_end = await connection()
    assert handshakes.admit(writer, host)
    handshakes.refusal(writer, f"{host}:40000", why)
    handshakes.done(writer)
    writer.close()
    other_end.close()


def test_one_line_per_address_and_reason_at_most_log_hosts_and_the_rest_summed_up_by_a_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        async with gate_logs(monkeypatch) as (handshakes, logs):
            hosts = [f"10.0.0.{n}" for n in range(LOG_HOSTS + 4)]
            for host in hosts:
                await refuse(handshakes, host, "wrong replication secret")
                await refuse(handshakes, host, "wrong replication secret")
            assert [len(logs.naming(host)) for host in hosts] == [1] * LOG_HOSTS + [0] * 4
            handshakes.abort_all()  # as a stop: the interval is summed up now
            summary = await logs.wait_for(lambda line: SUMMARY in line)
            assert f"{LOG_HOSTS + 8} more connection(s) refused" in summary and f"{2 * len(hosts)} refused" in summary
            # A timer sums an interval up when it ends, with no stop and no later event.
            monkeypatch.setattr(gate, "LOG_EVERY", TIMER)
            pair = [await connection() for _ in range(2)]
            assert [handshakes.admit(writer, "10.0.0.1") for writer, _ in pair] == [True, True]
            for n, (writer, _) in enumerate(pair):  # no await between: in one interval of TIMER
                handshakes.refusal(writer, f"10.0.0.1:4000{n}", "wrong replication secret")
            for writer, other_end in pair:
                handshakes.done(writer)
                writer.close()
                other_end.close()
            timed = await logs.wait_for(lambda line: SUMMARY in line and line != summary)
            assert "1 more connection(s) refused" in timed and f"{2 * len(hosts) + 2} refused" in timed, timed
            # The next interval names an address again.
            await refuse(handshakes, hosts[-1], "wrong replication secret")
            assert len(logs.naming(hosts[-1])) == 1
            assert handshakes.refused == 2 * len(hosts) + 3

    asyncio.run(main())


def test_an_address_that_varies_its_frames_takes_a_few_lines_not_every_line(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with gate_logs(monkeypatch) as (handshakes, logs):
            for length in range(3 * LOG_HOSTS):
                await refuse(handshakes, "10.0.0.66", f"malformed AUTH frame: {length} bytes")
            await refuse(handshakes, "10.0.0.2", "wrong replication secret")
            assert len(logs.naming("10.0.0.66")) == LOG_PER_HOST
            assert logs.naming("10.0.0.2") == [
                "replication: refused a connection from 10.0.0.2:40000: wrong replication secret"
            ]

    asyncio.run(main())


def test_connections_closed_at_once_have_their_own_line_and_go_into_the_same_summary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate's surplus used to be logged only when a later connection came: the last of a flood
    went unsaid."""

    async def main() -> None:
        async with gate_logs(monkeypatch) as (handshakes, logs):
            held = [await connection() for _ in range(2)]
            for writer, _ in held:
                assert handshakes.admit(writer, "10.0.0.9")
            handshakes.refusal(held[0][0], "10.0.0.9:40000", "no first frame within 10 s")
            handshakes.refusal(held[1][0], "10.0.0.9:40001", "no first frame within 10 s")
            surplus = [await connection() for _ in range(5)]
            assert [handshakes.admit(writer, "10.0.0.9") for writer, _ in surplus] == [False] * 5
            assert len([line for line in logs.naming("10.0.0.9") if "at once" in line]) == 1
            for writer, _ in held:
                handshakes.done(writer)
            handshakes.abort_all()  # as a stop: the interval is summed up now
            summary = await logs.wait_for(lambda line: SUMMARY in line)
            assert "1 more connection(s) refused by the handshake, 4 more closed at once and 0 more not in" in summary
            assert handshakes.turned_away == 5
            for writer, other_end in held + surplus:
                writer.close()
                other_end.close()

    asyncio.run(main())


def test_a_flood_of_connections_closed_at_once_does_not_take_the_lines_that_name_refusals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 64: turned-away connections from 16 addresses took every line of the interval, and a
    misconfigured backup's refusal went unnamed into the summary."""

    async def main() -> None:
        async with gate_logs(monkeypatch) as (handshakes, logs):
            surplus = []
            for n in range(LOG_HOSTS + 4):
                host = f"10.1.0.{n}"
                held = [await connection() for _ in range(3)]  # per_host 2: the third is closed at once
                assert [handshakes.admit(writer, host) for writer, _ in held] == [True, True, False]
                surplus += held
            await refuse(handshakes, "10.0.0.2", "wrong replication secret")
            assert len(logs.naming("10.0.0.2")) == 1
            assert len([line for line in logs.lines if "at once:" in line]) == LOG_HOSTS
            for writer, other_end in surplus:
                writer.close()
                other_end.close()

    asyncio.run(main())


def networks(*entries: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(entry) for entry in entries)


def test_allow_from_matches_ipv4_ipv6_and_scoped_peers() -> None:
    """A scoped peer (fe80::1%eth0) matches by its address alone."""
    allow = networks("10.0.0.0/24", "2001:db8::/64", "fe80::/64")
    for host in ("10.0.0.7", "2001:db8::5", "fe80::1%eth0"):
        assert allowed(host, allow), host
    for host in ("10.0.1.7", "2001:db8:1::5", "::1", "not an address"):
        assert not allowed(host, allow), host


def test_an_address_outside_allow_from_is_closed_at_once_takes_no_place_and_has_its_own_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood from more addresses than the log names, none allowed: each connection is aborted
    (its other end reads EOF), no place is taken (an allowed address still gets its 2), LOG_HOSTS
    lines name the first addresses, the summary counts the rest, and a refused handshake from an
    allowed address still gets its own line."""

    async def main() -> None:
        async with gate_logs(monkeypatch, networks("10.0.0.0/24")) as (handshakes, logs):
            outsiders = [f"192.0.2.{n}" for n in range(LOG_HOSTS + 4)]
            flood = [await connection() for _ in range(3 * len(outsiders))]
            hosts = [outsiders[n % len(outsiders)] for n in range(len(flood))]
            admitted = [handshakes.admit(writer, host) for (writer, _), host in zip(flood, hosts, strict=True)]
            assert admitted == [False] * len(flood)
            loop = asyncio.get_running_loop()
            for _, other_end in flood:
                other_end.setblocking(False)
                assert await asyncio.wait_for(loop.sock_recv(other_end, 1), 5.0) == b"", "closed at once"
            assert handshakes.not_allowed == handshakes.refusals == len(flood)
            insiders = [await connection() for _ in range(2)]
            assert [handshakes.admit(writer, "10.0.0.9") for writer, _ in insiders] == [True, True]
            handshakes.refusal(insiders[0][0], "10.0.0.9:40000", "wrong replication secret")
            named = [line for line in logs.lines if "not in replication.allow_from" in line]
            assert len(named) == LOG_HOSTS and "refused a connection from 192.0.2.0 at once" in named[0]
            assert len(logs.naming("10.0.0.9")) == 1, "the lines of the flood's kind are its own"
            for writer, _ in insiders:
                handshakes.done(writer)
            handshakes.abort_all()  # as a stop: the interval is summed up now
            summary = await logs.wait_for(lambda line: SUMMARY in line)
            assert f"{len(flood) - LOG_HOSTS} more not in allow_from" in summary, summary
            assert f"{len(flood)} not in allow_from" in summary, summary
            for writer, other_end in flood + insiders:
                writer.close()
                other_end.close()

    asyncio.run(main())


def test_a_primary_logs_a_refused_backup_name_once_a_minute_and_remembers_its_most_recently_refused_names() -> None:
    """A backup name refused for max_backups or for its name is logged at most once a minute, the
    refusals between counted in the next line; of the names refused, the REFUSED_NAMES most recently
    refused are remembered, so names a stranger makes up cannot grow the table."""
    now = [1000.0]
    refusals = NameBudgets(NAME_LOG_EVERY, REFUSED_NAMES, clock=lambda: now[0])
    assert refusals.of("a").take() == 0  # the first refusal: logged
    now[0] += NAME_LOG_EVERY - 0.5
    assert [refusals.of("a").take() for _ in range(3)] == [None] * 3  # within the minute: left out, counted
    assert refusals.of("b").take() == 0  # per name
    now[0] += 0.5
    assert refusals.of("a").take() == 3  # a minute after its last line: logged, with the count left out
    assert refusals.of("a").take() is None
    for n in range(REFUSED_NAMES - 1):
        refusals.of(f"n{n}").take()
    assert refusals.of("a").take() is None  # refused again: the most recent now
    refusals.of("one more").take()  # the least recently refused, n0, is forgotten
    assert refusals.of("n0").take() == 0  # logged as a first refusal again
    assert refusals.of("a").take() is None  # still remembered
