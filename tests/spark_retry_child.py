"""A Spark driver of its own for test_blind_readme2: runs docs/pipeline.md's streaming example (its
``get_session()``, so its default master) with the source reading through a TCP proxy that keeps silent the
first connection that asks for a stream (a read task's; the driver's planning connection never does). That
read task gets nothing for the source's ``timeout`` and fails; the page promises it "is run again, up to
Spark's task retries", and its retry's connection, like every later one, is forwarded.

    spark_retry_child.py CODE_FILE BROKER_PORT

CODE_FILE is the page's block, its port written ``PROXY_PORT`` and its paths absolute. Prints one JSON
line: the session's master, the query's error (null when none), the connections silenced and forwarded
after the first request for a stream, and the ids in the Parquet output, sorted. Exits 0 once it printed them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import sys
import threading
from pathlib import Path
from typing import Any

from amqtt_durable.process import HOST

DEADLINE = 120.0
"""Seconds the query may take, JVM start excluded (the test's own bound is above it)."""
TASK_REQUEST = b"stream_subscribe"
"""What a read task sends first on its connection (the driver's planning connection never does)."""


class SilencingProxy(socketserver.ThreadingTCPServer):
    """127.0.0.1:port -> the broker. The first connection that sends TASK_REQUEST gets nothing more
    forwarded either way (it stays open: its reader waits out its timeout); every later one is forwarded."""

    daemon_threads = True

    def __init__(self, upstream: int) -> None:
        super().__init__((HOST, 0), _Relay)
        self.upstream = upstream
        self.lock = threading.Lock()
        self.silent = True
        """No connection silenced yet (under ``lock``)."""
        self.silenced = 0
        self.forwarded = 0
        """Connections that sent TASK_REQUEST and were forwarded (under ``lock``)."""
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Relay(socketserver.BaseRequestHandler):
    """One connection through the proxy: a thread each way."""

    server: SilencingProxy

    def handle(self) -> None:
        broker = socket.create_connection((HOST, self.server.upstream), timeout=DEADLINE)
        self.request.settimeout(DEADLINE)
        muted = threading.Event()
        back = threading.Thread(target=self._pump, args=(broker, self.request, muted, False), daemon=True)
        back.start()
        self._pump(self.request, broker, muted, True)
        back.join(DEADLINE)

    def _pump(self, source: socket.socket, target: socket.socket, muted: threading.Event, outbound: bool) -> None:
        tail = b""
        asked = not outbound  # only the client's side asks for a stream
        try:
            while chunk := source.recv(65536):
                if not asked and TASK_REQUEST in tail + chunk:
                    asked = True
                    self._first_is_silenced(muted)
                tail = chunk[-len(TASK_REQUEST):]
                if not muted.is_set():
                    target.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):  # closed already
                    sock.shutdown(socket.SHUT_RDWR)

    def _first_is_silenced(self, muted: threading.Event) -> None:
        proxy = self.server
        with proxy.lock:
            if proxy.silent:
                proxy.silent = False
                muted.set()
                proxy.silenced += 1
            else:
                proxy.forwarded += 1


def main() -> int:
    code_file, broker_port = sys.argv[1], int(sys.argv[2])
    proxy = SilencingProxy(broker_port)
    namespace: dict[str, Any] = {"PROXY_PORT": proxy.port}
    exec(compile(Path(code_file).read_text(encoding="utf-8"), "pipeline.md", "exec"), namespace)
    spark, query = namespace["spark"], namespace["query"]
    outcome: dict[str, Any] = {"master": spark.sparkContext.master, "error": None}

    def run() -> None:
        try:
            query.processAllAvailable()
        except Exception as exc:  # the test reports it
            outcome["error"] = str(exc)[-3000:]

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(DEADLINE)
    query.stop()
    path = str(Path(code_file).parent / "out" / "events")  # where the test pointed the page's ./out
    ids = sorted(row.id for row in spark.read.parquet(path).collect()) if outcome["error"] is None else []
    with proxy.lock:
        outcome.update(silenced=proxy.silenced, forwarded=proxy.forwarded)
    outcome.update(ids=ids, finished=not runner.is_alive())
    print(json.dumps(outcome), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
