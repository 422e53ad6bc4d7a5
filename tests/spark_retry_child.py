"""A Spark driver of its own for test_blind_readme2: runs docs/pipeline.md's streaming example (its
``get_session()``, so its default master) with the source reading through a TCP proxy that keeps silent
every read task's stream until Spark reports a failed task. The first attempt of a read task gets nothing
for the source's ``timeout`` and fails; the page promises it "is run again, up to Spark's task retries".

    spark_retry_child.py CODE_FILE BROKER_PORT

CODE_FILE is the page's block, its port written ``PROXY_PORT`` and its paths absolute. Prints one JSON
line: the session's master, the most failed tasks one stage had, the query's error (null when none) and
the ids in the Parquet output, sorted. Exits 0 once it printed them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

from amqtt_durable.process import HOST, free_port

DEADLINE = 120.0
"""Seconds the query may take, JVM start excluded (the test's own bound is above it)."""
TASK_REQUEST = b"stream_subscribe"
"""What a read task sends first on its connection (the driver's planning connection never does)."""


class SilencingProxy(socketserver.ThreadingTCPServer):
    """127.0.0.1:port -> the broker. A connection that sends TASK_REQUEST while ``silent`` is set gets
    nothing more forwarded either way (it stays open: its reader waits out its timeout)."""

    daemon_threads = True

    def __init__(self, upstream: int) -> None:
        super().__init__((HOST, free_port()), _Relay)
        self.upstream = upstream
        self.silent = True
        self.silenced = 0
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
        try:
            while chunk := source.recv(65536):
                if outbound and self.server.silent and TASK_REQUEST in tail + chunk and not muted.is_set():
                    muted.set()
                    self.server.silenced += 1
                tail = chunk[-len(TASK_REQUEST):]
                if not muted.is_set():
                    target.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):  # closed already
                    sock.shutdown(socket.SHUT_RDWR)


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
    tracker = spark.sparkContext.statusTracker()
    failed = 0
    end = time.monotonic() + DEADLINE
    while runner.is_alive() and time.monotonic() < end:
        for stage in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage)
            failed = max(failed, info.numFailedTasks if info else 0)
        if failed and proxy.silenced:
            proxy.silent = False  # the retry gets through
        runner.join(0.05)  # a bounded wait for the query, between two looks at Spark's task counts
    query.stop()
    path = str(Path(code_file).parent / "out" / "events")  # where the test pointed the page's ./out
    ids = sorted(row.id for row in spark.read.parquet(path).collect()) if outcome["error"] is None else []
    outcome.update(failed=failed, silenced=proxy.silenced, ids=ids, finished=not runner.is_alive())
    print(json.dumps(outcome), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
