"""A replicated pair for ``amqtt-durable fleet --ha``: a real etcd, two brokers that replicate
(role auto, sync mode, short lease timing), a TCP relay between each broker and etcd, and the
router that makes the fault proxy the pair's virtual address.

Layout under ``out``: ``etcd/`` (its data and log), ``brokers/<name>/`` (``broker.yaml``,
``broker.log``, ``store/``).

The faults ``primary_kill`` and ``partition`` hit whichever broker is primary when they
begin; ``group_kill`` SIGKILLs both brokers at once (a full stop of the group, as a power cut)
and starts both again, so the pair must elect a primary by itself. Each begins only once the
pair is whole (one primary, the other a caught-up backup in the synchronous set etcd holds: the
only backup that may take over) and ends once it is whole again, so a primary_kill or a
partition never leaves the pair without a broker able to take over (a backup that is not
caught up takes the lease only after a full stop of the pair, as a group_kill is, and only as
the last primary or a member of its synchronous set: docs/replication.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqtt_durable.errors import DurableError
from amqtt_durable.process import HOST, BrokerProcess, EtcdProcess, free_port, local_config, stop_all
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.etcd import EtcdCoordinator
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.tool import ask

from .errors import BrokerLostError, FleetError
from .model import STOP_WAIT
from .proxy import Opened, TcpRelay

log = logging.getLogger(__name__)

NAMES = ("a", "b")
HA_TIMING: dict[str, Any] = {"lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5, "mode": "sync"}
"""A failover within about 2.5 s (docs/replication.md, timing argument)."""
CONNACK = 0x20
SERVER_UNAVAILABLE = 3
"""The CONNACK return code of a backup (or of a primary that stepped down)."""
STATUS_TIMEOUT = 1.0
"""Bound of one STATUS question to a node (it answers on its replication address)."""
ROUTE_WAIT = 15.0
"""How long the router looks for a primary for one device connection: a failover's length, and more."""
ROUTE_RETRY = 0.1
WHOLE_WAIT = 60.0
"""How long a fault waits for the pair to be whole (before it begins, and after it ended)."""
POLL = 0.1


@dataclass(frozen=True)
class Node:
    """Where to reach one broker of the pair: clients, and its replication address (STATUS)."""

    name: str
    port: int
    replication: str


async def node_status(node: Node) -> dict[str, Any] | None:
    """A node's STATUS answer, None when it does not answer (killed, starting) within STATUS_TIMEOUT."""
    try:
        async with asyncio.timeout(STATUS_TIMEOUT):
            return await ask(node.replication, Frame.STATUS)
    except (DurableError, TimeoutError):
        return None


class PrimaryRouter:
    """The pair's virtual address: each new device connection goes to the broker that is primary.

    It asks the nodes' STATUS for the primary, sends the device's CONNECT there and reads the
    CONNACK; a refused connection or a CONNACK 3 (a backup, or a primary that stepped down)
    makes it ask again, for up to ``wait`` seconds. Used from the loops of several proxies:
    its only state is the last primary found (a plain reference).
    """

    def __init__(self, nodes: list[Node], *, host: str = HOST, wait: float = ROUTE_WAIT,
                 connect_timeout: float = 5.0) -> None:
        self.nodes = nodes
        self.host = host
        self.wait = wait
        self.connect_timeout = connect_timeout
        self.current: Node | None = None
        """The broker the last connection went to."""

    async def primaries(self) -> list[Node]:
        """The nodes whose STATUS says primary now (two for a moment, when one is stepping down)."""
        answers = await asyncio.gather(*(node_status(node) for node in self.nodes))
        return [node for node, status in zip(self.nodes, answers, strict=True)
                if status is not None and status.get("role") == "primary"]

    async def open(self, connect: bytes, abandoned: Callable[[], bool]) -> Opened | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while not abandoned():
            current = self.current
            for node in [current] if current is not None else await self.primaries():
                opened = await self._try(node, connect)
                if opened is not None:
                    self.current = node
                    return opened
                if self.current is node:
                    self.current = None  # it refused or is gone: ask the nodes again
            if loop.time() >= deadline:
                raise ConnectionRefusedError(f"no broker of the pair accepted a client within {self.wait:g} s")
            if current is None:
                await asyncio.sleep(ROUTE_RETRY)  # a failover is under way; bounded by the deadline
        return None

    async def _try(self, node: Node, connect: bytes) -> Opened | None:
        """``node``'s connection with the CONNECT sent and its CONNACK read; None if it refused."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, node.port)
                writer.write(connect)
                await writer.drain()
                reply = await reader.readexactly(4)  # CONNACK: 0x20, 2, flags, return code
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("broker %s did not take a client: %r", node.name, exc)
            if writer is not None:
                writer.close()
            return None
        if reply[0] == CONNACK and reply[3] == SERVER_UNAVAILABLE:
            writer.close()
            return None
        return reader, writer, reply


class HaPair:
    """etcd, two relays to it and two brokers replicating; the faults that hit the primary."""

    def __init__(
        self, config: Mapping[str, Any], out: Path, *, metrics_interval: float, stop_wait: float = STOP_WAIT
    ) -> None:
        self.out = out
        self.stop_wait = stop_wait
        """Seconds a broker gets after its SIGTERM before its SIGKILL: at stop(), and when it is stopped
        while it starts (its ``wait``)."""
        self.config = config
        self.metrics_interval = metrics_interval
        self.etcd: EtcdProcess | None = None
        self.relays: dict[str, TcpRelay] = {}
        self.brokers: dict[str, BrokerProcess] = {}
        self.nodes: dict[str, Node] = {}
        self.router = PrimaryRouter([])

    # ------------------------------------------------------------------ set-up
    def start(self) -> HaPair:
        """etcd, then broker a (it bootstraps the cluster: primary), then b (its backup, caught up);
        on a failure, what was started is stopped again."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        try:
            self.etcd = EtcdProcess(self.out / "etcd")  # kept before it starts: stop() ends it, whatever comes
            self.etcd.start()
        except RuntimeError as exc:
            raise FleetError(f"--ha: {exc}") from exc
        for name in NAMES:
            relay = TcpRelay(HOST, self.etcd.client_port)
            relay.start()
            self.relays[name] = relay
            port = free_port()
            replication = {"name": name, "listen": f"{HOST}:{free_port()}",
                           "coordinator": [f"http://{relay.address}"], **HA_TIMING}
            ReplicationConfig.from_mapping(replication)  # a harness bug, not the user's: fails here
            config = local_config(self.config, port, store=str(self.out / "brokers" / name / "store"),
                                  metrics_interval=self.metrics_interval, replication=replication)
            (self.out / "brokers" / name).mkdir(parents=True, exist_ok=True)
            self.brokers[name] = BrokerProcess(config, self.out / "brokers" / name, port, wait=self.stop_wait)
            self.nodes[name] = Node(name, port, replication["listen"])
        self.router.nodes = list(self.nodes.values())
        for name in NAMES:
            try:
                self.brokers[name].start()
            except RuntimeError as exc:
                raise FleetError(str(exc)) from exc
            try:
                if name == NAMES[0]:
                    self._wait(lambda: self.primary() is not None, "broker a to become the first primary")
                else:
                    self.wait_whole()
            except BrokerLostError as exc:  # the run could not begin: bad input or set-up, not a verdict
                raise FleetError(str(exc)) from exc

    def stop(self) -> None:
        """Brokers first (a primary releases its lease), then the relays and etcd; bounded."""
        self._stop_brokers()
        for relay in self.relays.values():
            relay.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def _stop_brokers(self) -> None:
        """Stop every broker of the pair that runs (by its PID), in parallel: SIGKILLed if still running
        ``stop_wait`` after its SIGTERM."""
        stop_all(self.brokers.values(), self.stop_wait)

    # ------------------------------------------------------------------ state
    def status(self, name: str) -> dict[str, Any] | None:
        return asyncio.run(node_status(self.nodes[name]))

    def statuses(self) -> dict[str, dict[str, Any] | None]:
        return {name: self.status(name) for name in NAMES}

    def primary(self) -> str | None:
        """The broker that says it is primary now (None: none does)."""
        primaries = [name for name, status in self.statuses().items() if status and status["role"] == "primary"]
        return primaries[0] if len(primaries) == 1 else None

    def primary_pid(self) -> int | None:
        """The process of the broker the router sends devices to (for the CPU chart)."""
        node = self.router.current
        return self.brokers[node.name].pid if node is not None else None

    def sync_members(self) -> frozenset[str] | None:
        """The synchronous set the primary published in etcd (read straight from etcd)."""
        assert self.etcd is not None
        prefix = ReplicationConfig(coordinator=[self.etcd.url], name="fleet").prefix
        coordinator = EtcdCoordinator([self.etcd.url], prefix=prefix, ttl=HA_TIMING["lease_ttl"])
        with contextlib.suppress(DurableError, TimeoutError):
            return asyncio.run(coordinator.sync_members())
        return None

    def whole(self) -> bool:
        """One primary, whose backup is caught up, in sync and in the synchronous set."""
        statuses = self.statuses()
        primaries = [name for name, status in statuses.items() if status and status["role"] == "primary"]
        if len(primaries) != 1:
            return False
        (backup,) = [name for name in NAMES if name != primaries[0]]
        backup_status, primary_status = statuses[backup], statuses[primaries[0]]
        assert primary_status is not None
        in_sync = any(row["name"] == backup and row["state"] == "in_sync" for row in primary_status["backups"])
        members = self.sync_members()
        return (backup_status is not None and backup_status["role"] == "backup" and bool(backup_status["caught_up"])
                and in_sync and members is not None and backup in members)

    def wait_whole(self) -> float:
        """Wait until the pair is whole; the seconds it took. BrokerLostError naming the states if not."""
        return self._wait(self.whole, "one primary with a caught-up backup in its synchronous set")

    def _wait(self, ready: Callable[[], bool], what: str) -> float:
        started = time.monotonic()
        deadline = started + WHOLE_WAIT
        while not ready():
            for name, broker in self.brokers.items():
                if broker.proc is not None and not broker.running and broker.exit_status not in (None, -9):
                    raise BrokerLostError(f"broker {name} exited with status {broker.exit_status}; "
                                          f"see {broker.log_path}")
            if time.monotonic() > deadline:
                raise BrokerLostError(
                    f"the HA pair did not reach {what} within {WHOLE_WAIT:g} s: " + "; ".join(
                        f"{name}: {_describe(status)}" for name, status in self.statuses().items())
                    + f"; see {self.out / 'brokers'}"
                )
            time.sleep(POLL)  # polling the nodes' STATUS; bounded by the deadline
        return time.monotonic() - started

    # ------------------------------------------------------------------ faults
    def _whole_primary(self) -> str:
        self.wait_whole()
        primary = self.primary()
        if primary is None:
            raise BrokerLostError("the HA pair lost its primary while a fault began")
        return primary

    def kill_primary(self) -> str:
        """SIGKILL whichever broker is primary (once the pair is whole); its name."""
        name = self._whole_primary()
        self.brokers[name].kill()
        return name

    def restart(self, name: str) -> float:
        """Start a killed primary again once the other broker has taken over, so that it rejoins as
        a backup: started sooner (a ``for`` shorter than the lease), it could take the lease back
        itself and the fault would test no failover. Seconds until the pair is whole."""
        self._wait(lambda: self.primary() not in (None, name), f"a new primary after {name}'s SIGKILL")
        try:
            self.brokers[name].start()
        except RuntimeError as exc:
            raise BrokerLostError(f"broker {name} did not restart after its SIGKILL: {exc}") from exc
        return self.wait_whole()

    def kill_group(self) -> str:
        """SIGKILL both brokers at once (once the pair is whole): the signals are sent before either
        is reaped, so neither outlives the other by more than the kernel's delivery. The name of
        the broker that was primary."""
        name = self._whole_primary()
        for broker in self.brokers.values():
            if broker.proc is not None:
                broker.proc.kill()  # SIGKILL; reaped below
        for broker in self.brokers.values():
            broker.kill()  # reaps it (a no-op signal for one already dead)
        return name

    def restart_group(self) -> tuple[float, float]:
        """Start both killed brokers again at once: neither was told IN_SYNC since it started, so
        they elect a primary as after a full stop (docs/replication.md). The seconds from the
        restart until one is primary, and from then until the pair is whole; BrokerLostError
        naming both brokers' states if no primary is elected within WHOLE_WAIT. When a broker
        fails to start (or anything is raised while they start), those started already are
        stopped before the error goes on: no half of the pair is left running."""
        started = time.monotonic()
        try:
            try:
                for broker in self.brokers.values():
                    broker.spawn()
                for name, broker in self.brokers.items():
                    broker.await_ready(f"broker {name}", broker.ready, broker.ready_wait, f"open {HOST}:{broker.port}")
            except BaseException:
                self._stop_brokers()  # all were killed before: those running are the ones started here
                raise
        except RuntimeError as exc:
            raise BrokerLostError(f"the HA pair did not restart after its full stop: {exc}") from exc
        self._wait(lambda: self.primary() is not None, "an elected primary after its full stop")
        elected = time.monotonic() - started
        return elected, self.wait_whole()

    def partition_primary(self) -> str:
        """Cut whichever broker is primary off from etcd (once the pair is whole); its name."""
        name = self._whole_primary()
        self.relays[name].cut()
        return name

    def heal(self, name: str) -> float:
        """Reconnect ``name`` to etcd; seconds until the pair is whole again."""
        self.relays[name].heal()
        return self.wait_whole()


def _describe(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no answer"
    if status["role"] == "primary":
        rows = ", ".join(f"{row['name']} {row['state']}" for row in status["backups"]) or "no backup"
        return f"primary at batch {status['batch']} ({rows})"
    return f"backup at batch {status['batch']}, {status.get('state')}, caught up: {status.get('caught_up')}"
