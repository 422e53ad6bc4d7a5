"""Real brokers (subprocesses on 127.0.0.1 ports from free_port), real LevelDB, real paho clients."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from amqtt_durable.process import HOST, PORT_SLICE_ENV, BrokerProcess, ChildExitedError, free_port
from amqtt_durable.store import open_store
from amqtt_durable.wire import encode_packet, encode_string
from durable_client import DurableClient
from durable_client.persistence import SessionState

# the `etcd` fixture: a real etcd for the replication tests; `raws`: Raw makers; `relays`: PacketRelay makers
pytest_plugins = ["etcd_fixture", "raw_mqtt_helpers", "packet_relay"]

WAIT = 15.0
SPARK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""The JVM options the suite's Spark JVMs run with (pytest_configure): C1, the JIT's quick tier, only; the
serial garbage collector."""


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker (gw0, gw1, ...), free_port hands out this worker's block of its
    ports only (amqtt_durable.process.PORT_SLICE_ENV; inherited by every child it starts): the
    port a broker of one worker is about to bind, or bind again as it restarts, is never handed
    to a broker of another."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit():
        os.environ[PORT_SLICE_ENV] = f"{int(worker[2:])}/{count}"
    # Every Spark JVM of the suite (the `spark` fixture's, and those of the demo, the fleet and the docs'
    # examples started as child processes, which inherit this) compiles with the JIT's first tier only: a
    # JVM that lives for seconds to minutes on kilobytes of data spent more CPU compiling with C2 than running
    # (the demo test: 87 s of CPU, 66 s with this). Its small heap is collected by the serial collector:
    # G1's concurrent threads and barriers cost more CPU than they save (a session's start and six audits:
    # 57 s of CPU, was 63 s, less in four of four side-by-side pairs). Neither changes a result. Set only when the
    # caller set no submit arguments of their own (pyspark splits them as a shell does).
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-java-options {shlex.quote(SPARK_JVM)} pyspark-shell")


SPARK_TIMEOUT = 300
"""Seconds a test using the ``spark`` fixture may take: the first such test in each worker also starts the
session's JVM, which passed the suite's 120 s on a machine at load 4-7 and failed that worker's other Spark tests."""


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture scope), which would undo it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests using the session-wide ``spark`` fixture get SPARK_TIMEOUT unless they set their own
    (pytest-timeout counts a fixture's setup in the first test that uses it), and run first, in the order
    collected: xdist's worksteal hands each worker a contiguous share of the collection and the others
    take from the end of a queue, so the Spark tests stay with the first worker, which starts one JVM
    for all of them instead of one in each worker (a start and warm-up of seconds of CPU each), and
    none of them, or the module-scoped audit they share, starts late in a run's tail."""
    uses_spark = ["spark" in getattr(item, "fixturenames", ()) for item in items]
    for item, spark in zip(items, uses_spark, strict=True):
        if spark and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPARK_TIMEOUT))
    items[:] = [item for item, spark in zip(items, uses_spark, strict=True) if spark] + [
        item for item, spark in zip(items, uses_spark, strict=True) if not spark
    ]


class Broker(BrokerProcess):
    """An amqtt broker with the durable plugin, run by ``amqtt-durable broker`` as a child process."""

    def __init__(self, folder: Path, **plugin_settings: Any) -> None:
        super().__init__({}, folder, free_port(), wait=WAIT)
        self.folder = folder
        self.ws_port: int | None = None
        """Set before start() to add a websocket listener on this port."""
        self.tls: tuple[int, str] | None = None
        """Set before start() to add a TLS listener: its port, and a PEM file with its private key and
        certificate chain (replication_helpers.cluster_pki's "node")."""
        self.store = str(folder / "store")
        self.settings: dict[str, Any] = {"store": self.store, "metrics_interval": 0, **plugin_settings}
        self.extra_plugins: dict[str, Any] = {}
        self.pythonpath: list[str] = []
        """Folders the broker process imports extra plugins from."""

    def write_config(self) -> Path:
        listeners: dict[str, Any] = {"default": {"type": "tcp", "bind": f"{HOST}:{self.port}"}}
        if self.ws_port is not None:
            listeners["ws"] = {"type": "ws", "bind": f"{HOST}:{self.ws_port}"}
        if self.tls is not None:
            tls_port, pem = self.tls
            tls = {"ssl": True, "certfile": pem, "keyfile": pem}
            listeners["tls"] = {"type": "tcp", "bind": f"{HOST}:{tls_port}", **tls}
        self.config = {
            "listeners": listeners,
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                **self.extra_plugins,
                "amqtt_durable.DurableSessionsPlugin": self.settings,
            },
        }
        return super().write_config()

    def spawn(self) -> subprocess.Popen[bytes]:
        if self.pythonpath:
            path = os.pathsep.join([*self.pythonpath, os.environ.get("PYTHONPATH", "")])
            self.env = {**os.environ, "PYTHONPATH": path}
        return super().spawn()

    def ready(self) -> bool:
        """Ready = a real MQTT CONNECT gets a CONNACK."""
        return probe_connack(self.port)

    def start(self) -> Self:
        self.spawn()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = WAIT) -> None:
        try:
            ready = self.wait_until(self.ready, timeout)
        except ChildExitedError:
            raise AssertionError(f"broker exited with {self.exit_status}:\n{self.log()}") from None
        if not ready:
            raise AssertionError(f"broker not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the broker for the block (it reads, writes and acknowledges nothing), SIGCONT after, always."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)


def probe_connack(port: int) -> bool:
    """Send a minimal clean CONNECT and check for CONNACK accepted."""
    return connack_code(port) == 0


def connack_code(port: int) -> int | None:
    """The return code of the CONNACK a minimal clean CONNECT gets (3: a replication backup);
    None without one."""
    connect = bytes([0x10, 16, 0, 4]) + b"MQTT" + bytes([4, 0x02, 0, 10, 0, 4]) + b"prob"
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(connect)
            reply = sock.recv(4)
            with contextlib.suppress(OSError):  # a refused CONNECT's connection is closed already
                sock.sendall(bytes([0xE0, 0]))
            return reply[3] if reply[:1] == b"\x20" and len(reply) == 4 else None
    except OSError:
        return None


class Client:
    """A paho-mqtt client over TCP whose waits are bounded and event-driven."""

    def __init__(
        self,
        port: int,
        client_id: str,
        *,
        clean_session: bool = False,
        manual_ack: bool = False,
        auto_start: bool = True,
        username: str | None = None,
        transport: str = "tcp",
    ) -> None:
        self.port = port
        self.client_id = client_id
        self.paho = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            manual_ack=manual_ack,
            reconnect_on_failure=False,
            transport=transport,  # type: ignore[arg-type]
        )
        if username is not None:
            self.paho.username_pw_set(username, "any")
        self.paho.max_inflight_messages_set(100)
        self.paho.max_queued_messages_set(0)
        self.messages: list[mqtt.MQTTMessage] = []
        self.session_present: bool | None = None
        self._cond = threading.Condition()
        self._connected = threading.Event()
        self._disconnected = threading.Event()
        self._subacks: dict[int, list[int]] = {}
        self.paho.on_connect = self._on_connect
        self.paho.on_message = self._on_message
        self.paho.on_subscribe = self._on_subscribe
        self.paho.on_disconnect = self._on_disconnect
        self.on_message_hook: Callable[[mqtt.MQTTMessage], None] | None = None
        if auto_start:
            self.connect()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self.session_present = bool(flags.session_present)
        self.connect_reason = reason
        self._connected.set()

    def _on_disconnect(self, *args: Any) -> None:
        self._disconnected.set()

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()
        if self.on_message_hook is not None:
            self.on_message_hook(message)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        with self._cond:
            self._subacks[mid] = [int(r.value) if hasattr(r, "value") else int(r) for r in reasons]
            self._cond.notify_all()

    def connect(self, keepalive: int = 30) -> bool:
        self._connected.clear()
        self._disconnected.clear()
        self.paho.connect(HOST, self.port, keepalive=keepalive)
        self.paho.loop_start()
        assert self._connected.wait(WAIT), f"{self.client_id}: no CONNACK"
        assert self.session_present is not None
        return self.session_present

    def subscribe(self, topic_filter: str | list[tuple[str, int]], qos: int = 1) -> list[int]:
        """SUBSCRIBE (one filter, or a list of (filter, qos) in one packet); the SUBACK's return codes."""
        result, mid = self.paho.subscribe(topic_filter, qos)
        assert result == mqtt.MQTT_ERR_SUCCESS
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._subacks, WAIT), "no SUBACK"
            return self._subacks[mid]

    def unsubscribe(self, topic_filter: str | list[str]) -> None:
        """UNSUBSCRIBE (one filter, or a list in one packet); returns at its UNSUBACK."""
        done = threading.Event()
        self.paho.on_unsubscribe = lambda *a: done.set()
        self.paho.unsubscribe(topic_filter)
        assert done.wait(WAIT), "no UNSUBACK"

    def publish(self, topic: str, payloads: list[bytes], qos: int = 1, retain: bool = False) -> None:
        """Publish all and wait until every one is acknowledged (QoS>0) or written (QoS 0)."""
        infos = [self.paho.publish(topic, payload, qos=qos, retain=retain) for payload in payloads]
        deadline = time.monotonic() + WAIT + len(payloads) / 500
        for info in infos:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            assert info.is_published(), f"publish mid={info.mid} not acknowledged"

    def wait_messages(self, count: int, timeout: float = WAIT) -> list[mqtt.MQTTMessage]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.messages) >= count, timeout)
            return list(self.messages)

    def wait_for(self, predicate: Callable[[list[mqtt.MQTTMessage]], bool], timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.messages), timeout)

    def disconnect(self) -> None:
        self.paho.disconnect()
        self._disconnected.wait(WAIT)
        self.paho.loop_stop()

    def drop(self) -> None:
        """Abnormal disconnect: close the socket without DISCONNECT."""
        sock = self.paho.socket()
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)  # wakes paho's select, which then sees the connection gone
        self._disconnected.wait(WAIT)
        self.paho.loop_stop()

    def wait_disconnected(self, timeout: float = WAIT) -> bool:
        return self._disconnected.wait(timeout)


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``amqtt-durable ARGS`` as a child process, output captured, bounded in time; ``env``: its
    whole environment (None: ours). The bound is well above WAIT: a replication tool waits its own
    10 s for an answer, plus the interpreter's start on a loaded machine."""
    return subprocess.run(
        [sys.executable, "-m", "durable_fleet.console", *args],
        capture_output=True,
        text=True,
        timeout=4 * WAIT,
        check=False,
        cwd=cwd,
        env=env,
    )


def tool_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``amqtt-durable ARGS`` through its main() in this process: its exit status and stderr. For the tools
    (inspect, repair, promote), never ``broker``; a child interpreter per refusal cost up to a second, and
    run_cli keeps one run of each exit status from a process of its own."""
    from amqtt_durable.cli import main  # noqa: PLC0415 - amqtt_durable.cli only for the tests that use it

    return exit_status(lambda: main(list(args))), capsys.readouterr().err


def exit_status(run: Callable[[], int | None]) -> int:
    """The status a process running ``run`` as its main() would exit with: its return value, or a
    SystemExit's (argparse's usage errors: 2) as the interpreter takes it (None 0, a message 1)."""
    try:
        status = run()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return status or 0


def payloads(count: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i:07d}".encode() for i in range(count)]


def each_got_only(subscribers: list[Client], expected: list[bytes], quiet: float = 0.5) -> None:
    """Each of ``subscribers`` got ``expected``, in that order, and nothing more within ``quiet`` seconds after
    the last of them had it: one window watched on all of them at once (each is watched for the whole of it),
    not one window after another."""
    for subscriber in subscribers:
        subscriber.wait_for(lambda ms: len(ms) >= len(expected))
    quiet_until = time.monotonic() + quiet
    for subscriber in subscribers:
        left = max(0.0, quiet_until - time.monotonic())
        assert not subscriber.wait_for(lambda ms: len(ms) > len(expected), timeout=left), subscriber.client_id
        assert [m.payload for m in subscriber.messages] == expected, subscriber.client_id


def seen_away(clients: Callable[..., Client], broker: Broker, count: int) -> None:
    """Wait until the broker counts ``count`` disconnected durable sessions (its metrics, broker
    started with a short `metrics_interval`): a publish on another connection can otherwise be
    read before a DISCONNECT, while the session is still connected."""
    watcher = clients(broker.port, f"away-{count}", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/sessions/disconnected", 0)
    assert watcher.wait_for(lambda ms: any(m.payload == str(count).encode() for m in ms)), "not seen disconnected"
    watcher.disconnect()


def queued_while_dropped(
    clients: Callable[..., Client], port: int, topic_filter: str, topic: str, queued: list[bytes]
) -> tuple[Client, Client]:
    """Durable session dev-1 subscribes to ``topic_filter`` (QoS 1) and drops its connection; a
    clean publisher, pub, then publishes ``queued`` to ``topic`` (QoS 1): a queue to check after
    an attack. Returns (dev-1, pub), pub still connected."""
    device = clients(port, "dev-1")
    device.subscribe(topic_filter, 1)
    device.drop()
    publisher = clients(port, "pub", clean_session=True)
    publisher.publish(topic, queued, qos=1)
    return device, publisher


# --------------------------------------------------------------- raw MQTT 3.1.1 encoding
mqtt_packet = encode_packet
"""A packet: the first byte, the remaining length, the body (the plugin's own encoder)."""
mqtt_string = encode_string
"""A UTF-8 string field: its length in two bytes, then the bytes (the plugin's own encoder)."""


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    started: list[Broker] = []

    def make(start: bool = True, name: str = "b", **settings: Any) -> Broker:
        folder = tmp_path / f"{name}{len(started)}"
        folder.mkdir()
        broker = Broker(folder, **settings)
        started.append(broker)
        return broker.start() if start else broker

    yield make
    for broker in started:
        broker.stop()


@pytest.fixture
def broker(broker_factory: Callable[..., Broker]) -> Broker:
    return broker_factory()


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker with the default settings for the tests of a module that need nothing of their own (a
    start costs a second; a module's parametrized cases each starting one added up): each test uses
    client ids and topics of its own (``case_tag``), so none sees what another left behind."""
    broker = Broker(tmp_path_factory.mktemp("shared"))
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def case_tag(request: pytest.FixtureRequest) -> str:
    """A short name of this test, its parametrized case included (8 hex digits of its node id): client
    ids and topics of its own on a ``shared_broker``."""
    return f"{zlib.crc32(request.node.nodeid.encode()):08x}"


READERS = ["plugin-reader", "amqtt-reader"]


def read_by(broker: Broker, reader: str) -> Broker:
    """``broker`` (not started) read by the plugin's reader, or by amqtt's own loop (a topic plugin loaded:
    amqtt's TopicTabooPlugin, which refuses nothing used here): "the guarantees are the same there"
    (docs/guarantees.md)."""
    if reader == "amqtt-reader":
        broker.extra_plugins["amqtt.plugins.topic_checking.TopicTabooPlugin"] = {}
    return broker


@pytest.fixture(params=READERS)
def either_reader(request: pytest.FixtureRequest, broker_factory: Callable[..., Broker]) -> Broker:
    """A started broker on each reader (read_by)."""
    return read_by(broker_factory(start=False), request.param).start()


@pytest.fixture(scope="module", params=READERS)
def shared_reader(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """either_reader's broker once a module per reader, as shared_broker is (client ids of each test's own)."""
    broker = read_by(Broker(tmp_path_factory.mktemp(request.param)), request.param)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(port: int, client_id: str, **kwargs: Any) -> Client:
        client = Client(port, client_id, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.paho.disconnect()  # first, so that loop_stop need not wait out paho's select timeout
        client.paho.loop_stop()


@pytest.fixture
def sdk() -> Iterator[Callable[..., DurableClient]]:
    """SDK clients that retry quickly (a test's broker restarts at once), closed keeping their sessions."""
    made: list[DurableClient] = []

    def make(port: int, client_id: str, **kwargs: Any) -> DurableClient:
        client = DurableClient(client_id, port=port, reconnect_min_delay=0.05, reconnect_max_delay=0.5, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close(keep_session=True)


@pytest.fixture
def store_path(tmp_path: Path) -> str:
    """Where the ``db`` fixture's LevelDB store lives (for tests that reopen it)."""
    return str(tmp_path / "store")


@pytest.fixture
def db(store_path: str) -> Iterator[Any]:
    """A fresh store (amqtt_durable.store.open_store), closed after the test unless the test closed it."""
    handle = open_store(store_path)
    yield handle
    if not handle.closed:
        handle.close()


@pytest.fixture
def opened() -> Iterator[list[SessionState]]:
    """SDK session states (CPL-2 journals) to close after the test, so a failing test does not leave a folder locked."""
    states: list[SessionState] = []
    yield states
    for state in states:
        state.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] SparkSession for the whole test session (starting one costs seconds); run in
    parallel (pytest-xdist), one in each worker that runs a Spark test."""
    from durable_pipeline.spark import get_session  # noqa: PLC0415 - pyspark loads only for Spark tests

    session = get_session("local[2]", "amqtt-durable-tests")
    # The tests' data is tiny, so compiling generated code for each new query plan costs more than
    # running it: the tests evaluate interpreted (same results; Spark's own tests run both ways).
    # Adaptive execution is off: on kilobytes it only re-plans each stage (an audit took about a
    # quarter longer) to coalesce the shuffle's partitions into one, so the plans keep the one
    # shuffle partition it ended with. The demo test and the audit CLI tests that run the console
    # script run Spark's defaults in processes of their own.
    session.conf.set("spark.sql.codegen.wholeStage", "false")
    session.conf.set("spark.sql.codegen.factoryMode", "NO_CODEGEN")
    session.conf.set("spark.sql.adaptive.enabled", "false")
    session.conf.set("spark.sql.shuffle.partitions", "1")
    yield session
    session.stop()


def readme_example(heading: str, port: int, folder: Path) -> Path:
    """The README's first python block after `heading`, written to a script in `folder` as a user would run it
    against our broker: only its documented address "127.0.0.1", 1883 becomes the broker's port."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading) :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert '"127.0.0.1", 1883' in code, f"the example after {heading!r} no longer connects to 127.0.0.1:1883"
    script = folder / "readme_example.py"
    script.write_text(code.replace('"127.0.0.1", 1883', f'"127.0.0.1", {port}'), encoding="utf-8")
    return script


def refused(reply: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(code, op, req) of a control request's refusal."""
    assert reply["ok"] is False, reply
    return reply["error"]["code"], reply["op"], reply["req"]
