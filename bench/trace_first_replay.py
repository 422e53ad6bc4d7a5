#!/usr/bin/env python3
"""Where CONNECT -> first replayed message goes inside our broker: time stamps at its steps.

    # run the broker under the tracer (the stamps go to FR_TRACE), the rounds from first_replay.py:
    FR_TRACE=/tmp/trace.txt .venv/bin/python bench/first_replay.py --rounds 10 \\
        --ours-cmd ".venv/bin/python bench/trace_first_replay.py broker"
    # then the split, per round and its median (µs after the connection's accept):
    .venv/bin/python bench/trace_first_replay.py --split /tmp/trace.txt

As a broker command (any arguments but --split), it wraps the steps of a connection in amqtt and in the
plugin (at class or module level, before the broker starts) with a line each on entry (">") and exit ("<"):
``time.monotonic_ns()``, the event loop's pass number, the step; then runs ``amqtt-durable`` with those
arguments.  The first bytes a connection's StreamReader is fed are stamped too ("first-data").  Each stamp is
a write(2) of a few µs, so the absolute figures are a little high; the split is what it is for.

``--split`` takes the reconnects whose pump wrote a first batch within attach (a replay) and prints, per step,
when it was reached after the connection's accept, and the loop passes until the first PUBLISH left.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from amqtt import broker as amqtt_broker
from amqtt.mqtt.protocol import broker_handler, handler
from amqtt.plugins import manager

from amqtt_durable import amqtt_glue, cli, delivery, lifecycle, sessions, store

STEPS = [
    "first-data", "initialize_client_session<", "authenticate<", "_connect_durable>", "amqtt_connack>",
    "amqtt_connack<", "handler.start<", "client_message_loop>", "_attach>", "advance_sent_mark_for_attach<",
    "_start_flush<", "Pump.start>", "read_entry_run<", "read_stored_bodies<", "_fill_from_store<", "_write_batch<",
    "flush>", "flush<", "Pump.start<",
]


def launch(argv: list[str]) -> int:
    fd = os.open(os.environ["FR_TRACE"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    passes = [0]
    run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]

    def counted_run_once(self: Any) -> None:
        passes[0] += 1
        run_once(self)

    asyncio.base_events.BaseEventLoop._run_once = counted_run_once  # type: ignore[attr-defined]

    def mark(label: str) -> None:
        os.write(fd, f"{time.monotonic_ns()} {passes[0]} {label}\n".encode())

    def stamp(owner: Any, name: str, label: str | None = None) -> None:
        original: Callable[..., Any] = getattr(owner, name)
        step = label or name
        if asyncio.iscoroutinefunction(original):
            @functools.wraps(original)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                mark(step + ">")
                try:
                    return await original(*args, **kwargs)
                finally:
                    mark(step + "<")
            setattr(owner, name, wrapped_async)
        else:
            @functools.wraps(original)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                mark(step + ">")
                try:
                    return original(*args, **kwargs)
                finally:
                    mark(step + "<")
            setattr(owner, name, wrapped)

    feed = asyncio.StreamReader.feed_data

    def feed_data(self: asyncio.StreamReader, data: bytes) -> None:
        if not getattr(self, "_fr_seen", False):
            self._fr_seen = True  # type: ignore[attr-defined]
            mark(f"first-data({len(data)})")
        feed(self, data)

    asyncio.StreamReader.feed_data = feed_data  # type: ignore[method-assign]
    for name in ("client_connected", "initialize_client_session", "authenticate", "client_message_loop"):
        stamp(amqtt_glue.AmqttHooks, name)
    stamp(amqtt_glue, "_connect_durable")
    stamp(broker_handler.BrokerProtocolHandler, "mqtt_connack_authorize", "amqtt_connack")
    stamp(handler.ProtocolHandler, "start", "handler.start")
    stamp(manager.PluginManager, "fire_event")
    stamp(amqtt_broker.Broker, "_publish_session_retained_messages")
    stamp(lifecycle.SessionLifecycle, "attach")
    stamp(lifecycle.SessionLifecycle, "_attach")
    stamp(sessions.DurableSession, "advance_sent_mark_for_attach")
    stamp(sessions, "read_entry_run")
    stamp(sessions, "read_stored_bodies")
    stamp(delivery.Pump, "start", "Pump.start")
    stamp(delivery.Pump, "_fill_from_store")
    stamp(delivery.Pump, "_write_batch")
    stamp(amqtt_glue.HandlerTransport, "flush" if hasattr(amqtt_glue.HandlerTransport, "flush") else "_flush", "flush")
    stamp(store.GroupCommitter, "_start_flush")
    return cli.main(argv)


def split(path: str) -> None:
    rows = []
    with open(path) as lines:
        for line in lines:
            t, n, label = line.split(None, 2)
            rows.append((int(t), int(n), label.strip()))
    rounds = []
    for i, (_t, _n, label) in enumerate(rows):
        if label != "Pump.start>":
            continue
        end = next(j for j in range(i, len(rows)) if rows[j][2] == "Pump.start<")
        if not any(r[2] == "_write_batch>" for r in rows[i:end]):
            continue  # no first batch within attach: not a replay
        begin = max(j for j in range(i) if rows[j][2] == "client_connected>")
        last = next(j for j in range(i, len(rows)) if rows[j][2] == "flush<")
        rounds.append(rows[begin:max(last, end) + 1])
    print(f"{len(rounds)} replays; µs after client_connected> (the accept), median and each round")
    for step in STEPS:
        times = [next(((t - seg[0][0]) / 1000 for t, _n, label in seg if label.startswith(step)), None)
                 for seg in rounds]
        found = [x for x in times if x is not None]
        if found:
            print(f"{step:32s} {statistics.median(found):8.1f}  " + " ".join(f"{x:.0f}" for x in found))
    flushes = [next(n for _t, n, label in seg if label == "flush<") - seg[0][1] for seg in rounds]
    print("loop passes from the accept to the first PUBLISH's flush:", flushes)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--split":
        split(sys.argv[2])
        sys.exit(0)
    sys.exit(launch(sys.argv[1:]))
