"""amqtt internals the glue guards, exercised on an in-process broker (real TCP, real LevelDB).

The scenario runs in a child interpreter: it calls broker internals directly, and a process
that ran amqtt with an open LevelDB prints teardown noise that does not belong in pytest's output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import HOST, WAIT, free_port

CHILD_PRELUDE = """
import asyncio, os, struct, sys
from amqtt.broker import Broker


def durable_broker(port: int) -> Broker:
    \"\"\"An in-process broker with the durable plugin (store STORE) for anonymous clients on HOST:port.\"\"\"
    return Broker({
        "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}},
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            "amqtt_durable.DurableSessionsPlugin": {"store": STORE, "metrics_interval": 0},
        },
    })
"""
"""What every child script starts with, after HOST, STORE and WAIT (see ``run_child``)."""


def run_child(tmp_path: Path, name: str, script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run CHILD_PRELUDE and ``script`` in a child interpreter, with HOST, STORE (in ``tmp_path``)
    and WAIT set; its output."""
    path = tmp_path / f"{name}.py"
    constants = f"HOST, STORE, WAIT = {HOST!r}, {str(tmp_path / 'store')!r}, {WAIT}\n"
    path.write_text(constants + CHILD_PRELUDE + script)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, check=False)


MONITOR_RACE = """
PORT = {port}


def connect_packet(client_id: bytes) -> bytes:
    body = b"\\x00\\x04MQTT\\x04\\x00\\x00\\x3c" + struct.pack(">H", len(client_id)) + client_id
    return bytes([0x10, len(body)]) + body


async def main() -> str:
    broker = durable_broker(PORT)
    await broker.start()
    try:
        reader, writer = await asyncio.open_connection(HOST, PORT)
        writer.write(connect_packet(b"device"))
        if (await asyncio.wait_for(reader.readexactly(4), WAIT))[:1] != b"\\x20":
            return "no CONNACK"
        await broker._cleanup_session("device")  # what amqtt's monitor does with a session it picked earlier
        writer.write(b"\\xc0\\x00")  # PINGREQ
        try:
            reply = await asyncio.wait_for(reader.readexactly(2), WAIT)
        except asyncio.IncompleteReadError:
            return "connection closed"
        writer.close()
        return "alive" if reply == b"\\xd0\\x00" else f"unexpected {{reply!r}}"
    finally:
        await broker.shutdown()


print(asyncio.run(main()), flush=True)
os._exit(0)
"""


def test_session_monitor_cleanup_spares_a_reconnected_session(tmp_path: Path) -> None:
    """amqtt's monitor picks disconnected anonymous sessions, then cleans them up with awaits in
    between; a session that reconnected meanwhile must keep its new connection."""
    result = run_child(tmp_path, "monitor_race", MONITOR_RACE.format(port=free_port()), 2 * WAIT)
    assert result.stdout.strip() == "alive", result.stdout + result.stderr


RETAINED_TRIE = """
PORTS = {ports!r}


def packet(first: int, body: bytes) -> bytes:
    return bytes([first, len(body)]) + body


def publish(topic: bytes, payload: bytes, packet_id: int) -> bytes:
    return packet(0x33, struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + payload)


def state(broker: Broker) -> list[str]:
    table = broker.retained_messages
    found = [topic for topic, _ in table.matching("#")] + [topic for topic, _ in table.matching("$SYS/#")]
    if sorted(found) != sorted(table) or len(table.topics) != len(table):
        return [f"out of step: trie {{sorted(found)}}, table {{sorted(table)}}"]
    return sorted(topic for topic in table if not topic.startswith("$"))


async def run(port: int, retain: bool) -> list[str]:
    broker = durable_broker(port)
    await broker.start()
    try:
        if retain:
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(packet(0x10, b"\\x00\\x04MQTT\\x04\\x02\\x00\\x3c\\x00\\x03pub"))
            await asyncio.wait_for(reader.readexactly(4), WAIT)
            sends = [(b"a/1", b"x"), (b"a/2", b"y"), (b"b/1", b"z"), (b"a/2", b"")]  # the last deletes a/2
            for packet_id, (topic, payload) in enumerate(sends, 1):
                writer.write(publish(topic, payload, packet_id))
            for _ in sends:
                await asyncio.wait_for(reader.readexactly(4), WAIT)  # PUBACKs: stored and applied
            writer.write(b"\\xe0\\x00")
            writer.close()
        return state(broker)
    finally:
        await broker.shutdown()


async def main() -> None:
    print(await run(PORTS[0], True), flush=True)  # retained by publishes
    print(await run(PORTS[1], False), flush=True)  # loaded from the store at start-up


asyncio.run(main())
os._exit(0)
"""


def test_the_retained_topic_trie_follows_amqtts_table_through_publishes_and_a_restart(tmp_path: Path) -> None:
    """The trie the retained look-ups walk is amqtt's retained table's own (RetainedTable): set and
    cleared by publishes, emptied by amqtt's start, refilled from the store. On the old code the
    table was a plain dict, with no trie (this test then fails on ``table.matching``)."""
    ports = [free_port(), free_port()]
    result = run_child(tmp_path, "retained_trie", RETAINED_TRIE.format(ports=ports), 4 * WAIT)
    assert result.stdout.splitlines() == ["['a/1', 'b/1']", "['a/1', 'b/1']"], result.stdout + result.stderr


AMQTT_CLIENT = """
from amqtt.client import MQTTClient

PORT = {port}


async def main() -> str:
    broker = durable_broker(PORT)
    await broker.start()
    client = MQTTClient(client_id="embedded", config={{"auto_reconnect": False}})
    try:
        await asyncio.wait_for(client.connect(f"mqtt://{{HOST}}:{{PORT}}/"), WAIT)
        granted = await asyncio.wait_for(client.subscribe([("e/t", 1)]), WAIT)
        await asyncio.wait_for(client.publish("e/t", b"x", qos=1), WAIT)
        message = await asyncio.wait_for(client.deliver_message(), WAIT)
        await asyncio.wait_for(client.ping(), WAIT)
        await asyncio.wait_for(client.disconnect(), WAIT)
        return f"suback {{granted}} got {{message.publish_packet.payload.data!r}}"
    except Exception as exc:  # the answer is the test's evidence
        return f"failed: {{exc!r}}"
    finally:
        await broker.shutdown()


print(asyncio.run(main()), flush=True)
os._exit(0)
"""


def test_amqtts_own_client_in_the_brokers_process_connects_subscribes_and_pings(tmp_path: Path) -> None:
    """The decoder checks patch amqtt's fixed header reader for the whole process; amqtt's own client
    (a bridge, an app embedding the broker) reads CONNACK, SUBACK and PINGRESP through it, packets a
    server refuses from clients: the checks apply to the broker's connections only."""
    result = run_child(tmp_path, "amqtt_client", AMQTT_CLIENT.format(port=free_port()), 2 * WAIT)
    assert result.stdout.strip() == "suback [1] got b'x'", result.stdout + result.stderr
