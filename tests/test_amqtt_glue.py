"""amqtt internals the glue guards, exercised on an in-process broker (real TCP, real LevelDB).

The scenario runs in a child interpreter: it calls broker internals directly, and a process
that ran amqtt with an open LevelDB prints teardown noise that does not belong in pytest's output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import HOST, WAIT, free_port

MONITOR_RACE = """
import asyncio, os, struct, sys
from amqtt.broker import Broker

HOST, PORT, STORE, WAIT = {host!r}, {port}, {store!r}, {wait}


def connect_packet(client_id: bytes) -> bytes:
    body = b"\\x00\\x04MQTT\\x04\\x00\\x00\\x3c" + struct.pack(">H", len(client_id)) + client_id
    return bytes([0x10, len(body)]) + body


async def main() -> str:
    broker = Broker({{
        "listeners": {{"default": {{"type": "tcp", "bind": f"{{HOST}}:{{PORT}}"}}}},
        "plugins": {{
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {{"allow_anonymous": True}},
            "amqtt_durable.DurableSessionsPlugin": {{"store": STORE, "metrics_interval": 0}},
        }},
    }})
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
    script = tmp_path / "monitor_race.py"
    script.write_text(MONITOR_RACE.format(host=HOST, port=free_port(), store=str(tmp_path / "store"), wait=WAIT))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=2 * WAIT, check=False
    )
    assert result.stdout.strip() == "alive", result.stdout + result.stderr
