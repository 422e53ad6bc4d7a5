#!/usr/bin/env python3
"""SDK benchmark: "replay then live" delivery to application code, SDK vs plain paho, side by side.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_sdk.py --out /tmp/sdk.md     # N=20,000 queued + L=5,000 live, 3 rounds
    .venv/bin/python bench/bench_sdk.py --quick               # N=3,000 + L=1,000
    .venv/bin/python bench/bench_sdk.py --only plain,cpl1 --runs 5

One amqtt-durable broker (broker.yaml's settings, with the store in a temporary folder and
metrics off) serves three receivers, each run with a fresh client id:

  plain  paho-mqtt 2.x, clean_session=False, a raw on_message callback (the baseline)
  cpl1   the SDK's DurableClient, persistence="memory" (CPL-1)
  cpl2   the SDK's DurableClient, persistence="disk" (CPL-2 with group commit: each event's mark
         written at once, one fsync per group, the acks after it; the SDK's default fsync_batch and
         fsync_delay_ms unless --fsync-batch/--fsync-delay-ms say otherwise), state_dir in the
         temporary folder (same disk as the broker's store)

Each run: the receiver's durable session subscribes (QoS 1) and disconnects; a publisher process
queues N events for it; then the receiver connects (SDK: subscribe with a listener,
ready_for_events(), connect(); plain: connect, session present) while a second publisher process
publishes L live events as fast as its PUBACKs allow (at most --inflight unacknowledged).
Measured in the receiver, from just before connect: events/s to the listener until the last of
the N + L events, the first event, and (SDK) the marker (on_live); also the receiver process's CPU
time per event (all its threads, less sensitive to the noise of a shared machine than the rate,
and blind to waiting: it shows the client's own cost per event) and, for CPL-2, the fsyncs (events
per fsync). Correctness: every event
exactly once, each publisher's events in order, and no live event before the last queued one;
the receiver keeps listening --linger seconds after the last event to catch late duplicates.
A failure is printed in the table, repeated as a NOTE and makes the exit code 1.

Rounds: every receiver once per round, the order rotating from round to round, so the
receivers share the machine's noise; medians of --runs rounds, ratios per round and of the
medians. The broker is pinned to CPU 0, receivers and publishers to CPU 1 (--pin). Everything
talks to 127.0.0.1 only; every wait is bounded; only processes started here are signalled, by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shlex
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paho.mqtt.client as mqtt
import yaml
from _common import (
    BROKER_YAML,
    CLIENT_START_S,
    PLUGIN_DIR,
    PROTOCOL_DIR,
    RESULT_MARGIN_S,
    ROOT,
    SDK_DIR,
    SETTLE_S,
    VENV_BIN,
    BrokerProcess,
    add_pin_arguments,
    changed_files,
    check_pin_arguments,
    describe_pinning,
    fingerprint_digest,
    fmt_number,
    git_revision,
    listener_config,
    log,
    machine_info,
    pub_summary,
    run_in_temp_folder,
    run_publisher,
    snapshot_packages,
    source_fingerprint,
    write_config,
    write_report,
)
from _rawmqtt import (
    HOST,
    PAYLOAD_HEADER,
    PAYLOAD_SIZE,
    ClientProcess,
    Login,
    PublishResult,
    PubSpec,
    publisher_main,
    session_roundtrip,
)
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion

# The receiver processes import the SDK from sys.path as the parent had it when it started them: the snapshot
# copy first (see run()); RecvResult.sdk_module says which file they used.
import durable_client
from amqtt_durable.process import free_port
from durable_client import AsyncDurableClient, DurableClient, DurableClientError, Event, Marker

PLUGIN_KEY = "amqtt_durable.DurableSessionsPlugin"

PLAIN, CPL1, CPL2, ASYNC1, ASYNC2 = "plain", "cpl1", "cpl2", "async1", "async2"
RECEIVERS = (PLAIN, CPL1, CPL2, ASYNC1, ASYNC2)
TITLES = {
    PLAIN: "plain paho, clean_session=False",
    CPL1: 'SDK, persistence="memory" (CPL-1)',
    CPL2: 'SDK, persistence="disk" (CPL-2, group commit)',
    ASYNC1: 'asyncio SDK (AsyncDurableClient), persistence="memory" (CPL-1)',
    ASYNC2: 'asyncio SDK (AsyncDurableClient), persistence="disk" (CPL-2, group commit)',
}
SHORT = {PLAIN: "plain", CPL1: "SDK-CPL-1", CPL2: "SDK-CPL-2", ASYNC1: "async-CPL-1", ASYNC2: "async-CPL-2"}
PERSISTENCE = {CPL1: "memory", CPL2: "disk", ASYNC1: "memory", ASYNC2: "disk"}
RATIOS = ((CPL1, PLAIN), (CPL2, PLAIN), (CPL2, CPL1), (ASYNC1, PLAIN), (ASYNC2, PLAIN))
SETUP_S = 30.0  # bound of each step of a receiver's set-up (connect, subscribe, marker, close)
GO_WAIT_S = 600.0  # a receiver waits this long at most for "go" (the backlog is published meanwhile)
now_ns = time.monotonic_ns


# --------------------------------------------------------------------------- receiver process


@dataclass(frozen=True)
class RecvSpec:
    kind: str
    port: int
    client_id: str
    topic: str
    backlog_tag: bytes
    live_tag: bytes
    n: int
    live: int
    timeout: float  # receive phase, counted from connect
    idle: float  # give up after this long without a new event
    linger: float  # keep listening this long after the last event (late duplicates)
    state_dir: str | None = None
    cpus: tuple[int, ...] | None = None
    fsync_batch: int | None = None  # CPL-2 group commit; None: the SDK's default
    fsync_delay_ms: float | None = None


@dataclass
class RecvResult:
    kind: str
    session_present: bool = False
    t_connect_ns: int = 0  # just before connect()
    t_connack_ns: int = 0  # plain: on_connect; SDK: on_connected (after the hello reply)
    t_first_ns: int = 0
    t_last_ns: int = 0
    t_marker_ns: int = 0
    cpu_s: float | None = None  # CPU time of the receiver process (all threads), connect -> last event
    unique: int = 0
    duplicates: int = 0
    out_of_order: int = 0  # first deliveries that are not the next of their publisher
    live_early: int = 0  # live events delivered before the last queued one
    foreign: int = 0
    before_marker: int = 0  # events delivered before on_live
    marker: dict[str, Any] | None = None
    sdk_stats: dict[str, int] | None = None
    persistence_level: str | None = None
    fsyncs: int | None = None  # CPL-2: fsyncs of the group commit, connect -> end of the linger
    group_commit: str | None = None  # CPL-2: the client's fsync_batch and fsync_delay_ms
    sdk_module: str | None = None
    setup_events: int = 0  # events seen by the set-up connection (expected: none)
    end: str = ""
    error: str | None = None
    close_error: str | None = None


class Tally:
    """Counts what the listener gets: the same code behind every receiver, one call per event."""

    def __init__(self, spec: RecvSpec) -> None:
        self.streams = {spec.backlog_tag: 0, spec.live_tag: 1}
        self.sizes = (spec.n, spec.live)
        self.seen = (bytearray(spec.n), bytearray(spec.live))
        self.next = [0, 0]
        self.counts = [0, 0]
        self.total = spec.n + spec.live
        self.unique = self.duplicates = self.out_of_order = self.live_early = self.foreign = 0
        self.t_first = self.t_last = 0
        self.done = threading.Event()

    def add(self, payload: bytes) -> None:
        t = now_ns()
        if len(payload) != PAYLOAD_SIZE:
            self.foreign += 1
            return
        tag, seq, _sent = PAYLOAD_HEADER.unpack_from(payload)
        stream = self.streams.get(tag)
        if stream is None or seq >= self.sizes[stream]:
            self.foreign += 1
            return
        if not self.t_first:
            self.t_first = t
        seen = self.seen[stream]
        if seen[seq]:
            self.duplicates += 1
            return
        seen[seq] = 1
        if seq != self.next[stream]:
            self.out_of_order += 1
        self.next[stream] = seq + 1
        self.counts[stream] += 1
        if stream and self.counts[0] < self.sizes[0]:
            self.live_early += 1
        self.unique += 1
        self.t_last = t
        if self.unique == self.total:
            self.done.set()

    def copy_to(self, res: RecvResult) -> None:
        res.unique, res.duplicates, res.out_of_order = self.unique, self.duplicates, self.out_of_order
        res.live_early, res.foreign = self.live_early, self.foreign
        res.t_first_ns, res.t_last_ns = self.t_first, self.t_last


def _wait_go(pipe: Connection) -> None:
    if not pipe.poll(GO_WAIT_S):
        raise TimeoutError(f"no 'go' from the parent within {GO_WAIT_S:.0f} s")
    message = pipe.recv()
    if message != "go":
        raise RuntimeError(f"stopped before 'go' ({message!r})")


def _receive(tally: Tally, spec: RecvSpec, pipe: Connection, res: RecvResult, cpu0: float, *,
             pump: Callable[[], object], linger: Callable[[], object]) -> None:
    """Call pump() until all events arrived (or a bound); then linger() for spec.linger seconds.

    Sets res.end and res.cpu_s (this process's CPU time since `cpu0`, measured before the linger).
    """
    start = time.monotonic()
    end_at = start + spec.timeout
    last_unique, last_progress, next_check = -1, start, start
    end = "all received"
    while not tally.done.is_set():
        pump()
        now = time.monotonic()
        if now < next_check:
            continue
        next_check = now + 0.25
        if tally.unique != last_unique:
            last_unique, last_progress = tally.unique, now
        elif now - last_progress >= spec.idle:
            end = f"idle {spec.idle:g} s"
            break
        if now >= end_at:
            end = f"time bound ({spec.timeout:.0f} s)"
            break
        if pipe.poll():
            end = "stopped by the parent"
            break
    res.cpu_s = time.process_time() - cpu0
    res.end = end
    linger_end = time.monotonic() + spec.linger
    while time.monotonic() < linger_end:
        linger()


def _plain(spec: RecvSpec, pipe: Connection, tally: Tally, res: RecvResult) -> None:
    session_roundtrip(spec.port, spec.client_id, Login(), clean=False, topic=spec.topic, timeout=SETUP_S)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=spec.client_id, clean_session=False,
                         protocol=MQTTProtocolVersion.MQTTv311)
    add = tally.add

    def on_connect(_c: Any, _u: Any, flags: Any, _reason: Any, _p: Any) -> None:
        res.t_connack_ns = now_ns()
        res.session_present = bool(flags.session_present)

    def on_message(_c: Any, _u: Any, message: Any) -> None:
        add(message.payload)

    client.on_connect = on_connect
    client.on_message = on_message

    def pump() -> None:
        rc = client.loop(0.25)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"paho loop returned {rc!r} after {tally.unique:,} events")

    pipe.send(("subscribed", None))
    _wait_go(pipe)
    cpu0 = time.process_time()
    res.t_connect_ns = now_ns()
    client.connect(HOST, spec.port, keepalive=30)
    try:
        _receive(tally, spec, pipe, res, cpu0, pump=pump, linger=lambda: client.loop(0.05))
    finally:
        client.disconnect()
        client.loop(0.1)


def _set_up_session(spec: RecvSpec, res: RecvResult, persistence: str) -> None:
    """An SDK session (hello) subscribed at QoS 1, then a clean disconnect (keep the session)."""
    res.sdk_module = durable_client.__file__
    setup_live = threading.Event()
    setup_events: list[int] = []
    setup = DurableClient(spec.client_id, HOST, spec.port, persistence=persistence, state_dir=spec.state_dir,
                          on_live=lambda _marker: setup_live.set())
    try:
        setup.subscribe(spec.topic, 1, listener=lambda event: setup_events.append(event.seq))
        setup.ready_for_events()
        setup.connect(timeout=SETUP_S)
        if not setup_live.wait(SETUP_S):
            raise TimeoutError(f"set-up: no marker within {SETUP_S:.0f} s")
    finally:
        setup.close(keep_session=True, timeout=SETUP_S)
    res.setup_events = len(setup_events)


def _client_options(spec: RecvSpec, tally: Tally, res: RecvResult) -> dict[str, Any]:
    """The measured client's options: persistence, group commit, and callbacks that time the run."""

    def on_live(marker: Marker) -> None:
        if res.marker is None:
            res.t_marker_ns = now_ns()
            res.before_marker = tally.unique
            res.marker = {"replayed": marker.replayed, "first_seq": marker.first_seq, "last_seq": marker.last_seq}

    def on_connected(info: Any) -> None:
        if not res.t_connack_ns:
            res.t_connack_ns = now_ns()
            res.session_present = info.session_present

    options: dict[str, Any] = {"persistence": PERSISTENCE[spec.kind], "state_dir": spec.state_dir,
                               "on_live": on_live, "on_connected": on_connected}
    if spec.fsync_batch is not None:
        options["fsync_batch"] = spec.fsync_batch
    if spec.fsync_delay_ms is not None:
        options["fsync_delay_ms"] = spec.fsync_delay_ms
    return options


def _record_client(client: DurableClient, res: RecvResult) -> None:
    res.sdk_stats = dataclasses.asdict(client.stats)
    res.persistence_level = client.persistence_level
    gate = client._gate  # the group commit's own count (not a public statistic)
    res.fsyncs = gate.groups if gate is not None else None
    res.group_commit = f"fsync_batch={gate.batch}, fsync_delay_ms={gate.delay_ms:g}" if gate is not None else None


def _sdk(spec: RecvSpec, pipe: Connection, tally: Tally, res: RecvResult) -> None:
    _set_up_session(spec, res, PERSISTENCE[spec.kind])
    add = tally.add

    def listener(event: Event) -> None:
        add(event.payload)

    client = DurableClient(spec.client_id, HOST, spec.port, **_client_options(spec, tally, res))
    try:
        client.subscribe(spec.topic, 1, listener=listener)
        client.ready_for_events()
        pipe.send(("subscribed", None))
        _wait_go(pipe)
        cpu0 = time.process_time()
        res.t_connect_ns = now_ns()
        client.connect(timeout=SETUP_S)
        _receive(tally, spec, pipe, res, cpu0, pump=lambda: tally.done.wait(0.25), linger=lambda: time.sleep(0.05))
        _record_client(client, res)
    finally:
        try:
            client.close(keep_session=False, timeout=SETUP_S)
        except DurableClientError as exc:
            res.close_error = f"{type(exc).__name__}: {exc}"


async def _consume(client: AsyncDurableClient, tally: Tally) -> None:
    add = tally.add
    async with client.events() as events:
        async for event in events:
            add(event.payload)
            if tally.done.is_set():
                break


def _async_sdk(spec: RecvSpec, pipe: Connection, tally: Tally, res: RecvResult) -> None:
    """The asyncio client: its event loop runs in a thread of this process, ``async for`` feeds the tally."""
    _set_up_session(spec, res, PERSISTENCE[spec.kind])
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="asyncio", daemon=True)
    runner.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(SETUP_S)

    client = AsyncDurableClient(spec.client_id, HOST, spec.port, **_client_options(spec, tally, res))
    consumer: Any = None
    try:
        call(client.subscribe(spec.topic, 1))
        call(client.ready_for_events())
        pipe.send(("subscribed", None))
        _wait_go(pipe)
        cpu0 = time.process_time()
        res.t_connect_ns = now_ns()
        call(client.connect())
        consumer = asyncio.run_coroutine_threadsafe(_consume(client, tally), loop)
        _receive(tally, spec, pipe, res, cpu0, pump=lambda: tally.done.wait(0.25), linger=lambda: time.sleep(0.05))
        _record_client(client._client, res)
    finally:
        try:
            call(client.close(keep_session=False))
        except DurableClientError as exc:
            res.close_error = f"{type(exc).__name__}: {exc}"
        if consumer is not None:
            consumer.cancel()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(SETUP_S)


def receiver_main(spec: RecvSpec, pipe: Connection) -> None:
    """Child process: set up the session, report ("subscribed"), wait for "go", receive, report ("result")."""
    res = RecvResult(spec.kind)
    tally: Tally | None = None
    try:
        if spec.cpus:
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setaffinity(0, set(spec.cpus))
        tally = Tally(spec)
        {PLAIN: _plain, ASYNC1: _async_sdk, ASYNC2: _async_sdk}.get(spec.kind, _sdk)(spec, pipe, tally, res)
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if tally is not None:
        tally.copy_to(res)
    with contextlib.suppress(OSError):
        pipe.send(("result", res))


# --------------------------------------------------------------------------- one receiver run (parent side)


@dataclass
class Run:
    kind: str
    label: str
    n: int
    live: int
    res: RecvResult | None = None
    backlog: PublishResult | None = None
    live_pub: PublishResult | None = None
    problems: list[str] = field(default_factory=list)

    def ms(self, t_ns: int) -> float | None:
        if self.res is None or not t_ns or not self.res.t_connect_ns:
            return None
        return (t_ns - self.res.t_connect_ns) / 1e6

    def fmt_ms(self, t_ns: int) -> str:
        value = self.ms(t_ns)
        return "—" if value is None else fmt_number(value)

    @property
    def rate(self) -> float | None:
        """Events/s to the listener, connect -> last event, when all N + L arrived."""
        r = self.res
        if r is None or r.unique < self.n + self.live or r.t_last_ns <= r.t_connect_ns:
            return None
        return r.unique / ((r.t_last_ns - r.t_connect_ns) / 1e9)

    @property
    def cpu_us(self) -> float | None:
        """The receiver process's CPU time per event (µs), connect -> last event, when all N + L arrived."""
        r = self.res
        if r is None or r.cpu_s is None or r.unique < self.n + self.live:
            return None
        return r.cpu_s / r.unique * 1e6


@dataclass
class Ctx:
    args: argparse.Namespace
    broker: BrokerProcess
    state_dir: Path
    notes: list[str] = field(default_factory=list)
    counter: int = 0

    def tag(self) -> bytes:
        self.counter += 1
        return os.urandom(2) + self.counter.to_bytes(2, "big")

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)


def check(run: Run) -> list[str]:
    """Every correctness failure of one run, in words."""
    problems: list[str] = []
    r, total = run.res, run.n + run.live
    for what, pr, want in (("queueing publisher", run.backlog, run.n), ("live publisher", run.live_pub, run.live)):
        if pr is not None and (pr.acked < want or pr.error):
            problems.append(f"{what}: {pub_summary(pr)} PUBACKed")
    if r is None:
        return problems
    if r.error:
        problems.append(f"receiver error: {r.error}")
    if not r.session_present:
        problems.append("session_present=0 on reconnect")
    if r.unique < total:
        problems.append(f"missing {total - r.unique:,} of {total:,} ({r.end})")
    for count, what in ((r.duplicates, "duplicates"), (r.out_of_order, "out of order"),
                        (r.live_early, "live events before the last queued one"), (r.foreign, "foreign events"),
                        (r.setup_events, "events delivered to the set-up connection")):
        if count:
            problems.append(f"{count:,} {what}")
    if run.kind != PLAIN:
        problems += sdk_problems(run, r)
    return problems


def sdk_problems(run: Run, r: RecvResult) -> list[str]:
    """What an SDK receiver must also get right: the marker after the backlog, no fallback."""
    problems: list[str] = []
    if r.marker is None:
        problems.append("no marker (on_live)")
    else:
        if r.before_marker < run.n:
            problems.append(f"marker after {r.before_marker:,} events, before all {run.n:,} queued ones")
        if r.marker["replayed"] != r.before_marker:
            problems.append(f"marker says replayed={r.marker['replayed']:,}, listener got "
                            f"{r.before_marker:,} before it")
    want_level = PERSISTENCE[run.kind]
    if r.persistence_level not in (None, want_level):
        problems.append(f"persistence level {r.persistence_level} at the end (expected {want_level}: fallback?)")
    return problems


def publish_backlog(ctx: Ctx, pub_id: str, topic: str, tag: bytes, n: int) -> PublishResult:
    spec = PubSpec(ctx.broker.port, pub_id, Login(), topic, tag, n, ctx.args.inflight, ctx.args.timeout,
                   cpus=ctx.args.client_cpus)
    with ClientProcess("queueing publisher", publisher_main, spec) as pub:
        return run_publisher(pub, ctx.args.timeout)


def run_receiver(ctx: Ctx, kind: str, label: str, n: int, live: int) -> Run:
    args = ctx.args
    run = Run(kind, label, n, live)
    backlog_tag, live_tag = ctx.tag(), ctx.tag()
    suffix = f"{kind}-{label}-{backlog_tag.hex()}"
    client_id, topic = f"sdkbench-{suffix}", f"sdkbench/{suffix}"
    if not ctx.broker.alive():
        ctx.note(f"the broker was not running before {kind} {label}; restarting it. "
                 f"Last log line: {ctx.broker.last_log_line()!r}")
        ctx.broker.start(args.startup_timeout)
    spec = RecvSpec(kind, ctx.broker.port, client_id, topic, backlog_tag, live_tag, n, live, args.timeout, args.idle,
                    args.linger, str(ctx.state_dir) if PERSISTENCE.get(kind) == "disk" else None, args.client_cpus,
                    args.fsync_batch, args.fsync_delay_ms)
    live_spec = PubSpec(ctx.broker.port, f"live-{suffix}", Login(), topic, live_tag, live, args.live_inflight,
                        args.timeout, cpus=args.client_cpus)
    t0 = time.perf_counter()
    try:
        with ClientProcess(f"{kind} receiver", receiver_main, spec) as rx:
            rx.expect("subscribed", CLIENT_START_S + SETUP_S)
            time.sleep(SETTLE_S)  # the broker has processed the DISCONNECT: the backlog is queued, not sent
            run.backlog = publish_backlog(ctx, f"pub-{suffix}", topic, backlog_tag, n)
            with ClientProcess("live publisher", publisher_main, live_spec) as lp:
                lp.expect("ready", CLIENT_START_S)
                rx.send("go")
                lp.send("go")
                run.live_pub = lp.expect("result", args.timeout + RESULT_MARGIN_S)
                run.res = rx.expect("result", args.timeout + args.linger + SETUP_S + RESULT_MARGIN_S)
    except Exception as exc:
        run.problems.append(f"run aborted: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):  # the SDK ends its session itself; this covers plain and failures
            session_roundtrip(ctx.broker.port, client_id, Login(), clean=True, topic=None, timeout=SETUP_S)
    run.problems += check(run)
    r = run.res
    if r is not None and r.close_error:
        ctx.note(f"{kind} {label}: close(keep_session=False) failed: {r.close_error}")
    rate = run.rate
    log(f"  {kind} {label}: {rate or 0:,.0f} events/s, first {run.ms(r.t_first_ns) if r else None} ms, "
        f"marker {run.ms(r.t_marker_ns) if r else None} ms; {r.unique if r else 0:,}/{n + live:,}; "
        f"{'OK' if not run.problems else 'FAILED: ' + '; '.join(run.problems)} ({time.perf_counter() - t0:.1f} s)")
    for problem in run.problems:
        ctx.note(f"CORRECTNESS FAILURE: {TITLES[kind]}, {label}: {problem}")
    return run


# --------------------------------------------------------------------------- report


def fmt_runs(values: list[float | None], digits: Callable[[float], str] = fmt_number) -> str:
    nums = [v for v in values if v is not None]
    if not nums:
        return "—"
    text = digits(statistics.median(nums))
    if len(nums) > 1:
        text += f" ({digits(min(nums))}-{digits(max(nums))})"
    if len(nums) < len(values):
        text += f" [{len(values) - len(nums)} of {len(values)} rounds without a value]"
    return text


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"


def median_of(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return statistics.median(nums) if nums else None


def render(args: argparse.Namespace, info: dict[str, str], command: str, *, runs: dict[str, list[Run]],
           warmups: list[Run], notes: list[str], started: datetime, elapsed: float) -> str:
    kinds = [k for k in RECEIVERS if k in runs]
    group_settings = {run.res.group_commit for kind in (CPL2, ASYNC2) for run in runs.get(kind, [])
                      if run.res and run.res.group_commit}
    rates = {k: [run.rate for run in runs[k]] for k in kinds}
    pinning = describe_pinning(args, "receivers and publishers")
    lines = [
        "# SDK: replay then live",
        "",
        f"- command: `{command}`",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- machine: nproc={info['nproc']}, {info['cpu']}, RAM {info['ram']}, {info['os']}; {pinning}",
        f"- python: {info['python']}; {info['packages']}",
        f"- git: {info['git']}",
        f"- code under test: {info['code']}",
        f"- load: N={args.n:,} events queued while the receiver is away, then L={args.live:,} live events published "
        f"from connect on (raw QoS 1 publisher processes, 64-byte payloads, at most {args.inflight} unacknowledged"
        + ("" if args.live_inflight == args.inflight else f", the live one {args.live_inflight}") + "); "
        f"median (min-max) of {args.runs} rounds, receiver order rotating per round; broker: broker.yaml's settings, "
        "store in a temporary folder, metrics off",
        "- CPL-2 group commit: " + (", ".join(sorted(group_settings)) or "—")
        + (" (the SDK's defaults)" if args.fsync_batch is None and args.fsync_delay_ms is None else ""),
        "",
        "| receiver | events/s to the listener (connect -> last of N + L) | vs plain | connect -> first event (ms) "
        "| connect -> marker, on_live (ms) | receiver CPU per event (µs) | correctness |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    plain_median = median_of(rates.get(PLAIN, []))
    for kind in kinds:
        kruns = runs[kind]
        med = median_of(rates[kind])
        vs = fmt_ratio(med / plain_median) if med is not None and plain_median else "—"
        failed = [run for run in kruns if run.problems]
        correct = (f"ok in all {len(kruns)} rounds" if not failed else
                   "**FAILED**: " + "; ".join(f"{run.label}: {', '.join(run.problems)}" for run in failed))
        marker = "n/a" if kind == PLAIN else fmt_runs([run.ms(run.res.t_marker_ns) if run.res else None
                                                       for run in kruns])
        lines.append(f"| {TITLES[kind]} | {fmt_runs(rates[kind])} | {vs} | "
                     f"{fmt_runs([run.ms(run.res.t_first_ns) if run.res else None for run in kruns])} | {marker} | "
                     f"{fmt_runs([run.cpu_us for run in kruns])} | {correct.replace('|', '/')} |")
    lines += ["", "| ratio (events/s) | of the medians | per round (same-round pairs) |", "|---|---:|---|"]
    for a, b in RATIOS:
        if a not in rates or b not in rates:
            continue
        ma, mb = median_of(rates[a]), median_of(rates[b])
        of_medians = fmt_ratio(ma / mb) if ma is not None and mb else "—"
        per_round = [fmt_ratio(x / y) if x is not None and y else "—" for x, y in zip(rates[a], rates[b], strict=True)]
        lines.append(f"| {SHORT[a]} / {SHORT[b]} | {of_medians} | {', '.join(per_round)} |")
    lines += [
        "",
        "Per run. Times in ms after the receiver's connect. Session set up: plain at the CONNACK, SDK at "
        "on_connected (after the hello reply). The live publisher's first send and last PUBACK show when the live "
        "events entered the broker, compared with the last event delivered.",
        "",
        "| round | receiver | events/s | first event | session set up | marker | events before the marker "
        "(marker's replayed) | live publisher: first send - last PUBACK | last event | SDK duplicates dropped "
        "| CPL-2 fsyncs (events per fsync) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_round = sorted((run for kind in kinds for run in runs[kind]), key=lambda run: run.label)
    for run in by_round:
        r = run.res
        if r is None:
            lines.append(f"| {run.label} | {SHORT[run.kind]} | — | | | | | | | | |")
            continue
        ms = run.fmt_ms
        marker = "n/a" if run.kind == PLAIN else (
            f"{r.before_marker:,} ({r.marker['replayed']:,})" if r.marker is not None else "no marker")
        live = (f"{ms(run.live_pub.t_first_send_ns)} - {ms(run.live_pub.t_last_ack_ns)}"
                if run.live_pub is not None else "—")
        dropped = "n/a" if r.sdk_stats is None else f"{r.sdk_stats['duplicates_dropped']:,}"
        fsyncs = "n/a" if r.fsyncs is None else f"{r.fsyncs:,} ({r.unique / r.fsyncs:.1f})" if r.fsyncs else "0"
        lines.append(f"| {run.label} | {SHORT[run.kind]} | {fmt_number(run.rate) if run.rate else '—'} | "
                     f"{ms(r.t_first_ns)} | {ms(r.t_connack_ns)} | {ms(r.t_marker_ns) if r.marker else 'n/a'} | "
                     f"{marker} | {live} | {ms(r.t_last_ns)} | {dropped} | {fsyncs} |")
    if warmups:
        failed = [run for run in warmups if run.problems]
        lines += ["", f"- warm-up (one small run per receiver, N={warmups[0].n:,}, L={warmups[0].live:,}, not in the "
                  "figures): " + ("ok" if not failed else "**FAILED**: " + "; ".join(
                      f"{SHORT[run.kind]}: {', '.join(run.problems)}" for run in failed))]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="events queued while away (default 20000; quick 3000)")
    p.add_argument("--live", type=int, default=None, help="live events published from connect on (default 5000; "
                   "quick 1000)")
    p.add_argument("--inflight", type=int, default=100, help="max unacknowledged PUBLISHes per publisher (default 100)")
    p.add_argument("--live-inflight", type=int, default=None,
                   help="max unacknowledged PUBLISHes of the live publisher (default: --inflight, i.e. as fast as "
                        "the PUBACKs allow; 1 spreads the live events over a longer time at a lower rate)")
    p.add_argument("--fsync-batch", type=int, default=None,
                   help="CPL-2 receiver's fsync_batch (default: the SDK's default)")
    p.add_argument("--fsync-delay-ms", type=float, default=None,
                   help="CPL-2 receiver's fsync_delay_ms (default: the SDK's default)")
    p.add_argument("--runs", type=int, default=3, help="rounds (default 3; medians reported)")
    p.add_argument("--only", default=",".join(RECEIVERS),
                   help=f"receivers to run, comma-separated from {','.join(RECEIVERS)} (default all)")
    p.add_argument("--quick", action="store_true", help="smoke run: small numbers")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one small unrecorded run per receiver first (default on)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--timeout", type=float, default=None,
                   help="time bound of a receive phase and of each publisher (default max(120, (N+L)/100) s)")
    p.add_argument("--idle", type=float, default=None,
                   help="stop receiving after this many seconds without a new event (default 10; quick 5)")
    p.add_argument("--linger", type=float, default=0.5,
                   help="keep listening this long after the last event, to catch late duplicates (default 0.5 s)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="time bound of a broker start (s)")
    add_pin_arguments(p, "the broker", "receivers and publishers")
    p.add_argument("--code", choices=("head", "worktree", "live"), default="head",
                   help="code under test: plugin/amqtt_durable, client_sdk/durable_client and durable_protocol "
                        "copied at start from git HEAD (default: exactly the reported revision) or from the working "
                        "tree, or 'live': imported from the working tree as it is when each process starts")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (config, log, store, state)")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = 3000 if args.quick else 20_000
    if args.live is None:
        args.live = 1000 if args.quick else 5000
    if args.timeout is None:
        args.timeout = max(120.0, (args.n + args.live) / 100)
    if args.idle is None:
        args.idle = 5.0 if args.quick else 10.0
    args.only = [k.strip().lower() for k in args.only.split(",") if k.strip()]
    if not args.only or set(args.only) - set(RECEIVERS):
        p.error(f"--only takes receivers from {','.join(RECEIVERS)}")
    if args.live_inflight is None:
        args.live_inflight = args.inflight
    if args.n < 1 or args.live < 1 or args.runs < 1 or not 1 <= min(args.inflight, args.live_inflight) <= max(
            args.inflight, args.live_inflight) < 65535:
        p.error("--n, --live and --runs must be positive, --inflight and --live-inflight from 1 to 65534")
    if max(args.n, args.live) >= 2**32:
        p.error("--n and --live must fit in 32 bits")
    check_pin_arguments(p, args)
    if not args.pin:
        args.broker_cpus = args.client_cpus = None
    return args


def build_broker(args: argparse.Namespace, tmp: Path, snapshot: Path | None) -> BrokerProcess:
    """broker.yaml's settings with our port, the store in `tmp` and metrics off."""
    config = yaml.safe_load(BROKER_YAML.read_text(encoding="utf-8"))
    port = free_port()
    config["listeners"] = listener_config(port)
    config["plugins"][PLUGIN_KEY].update({"store": str(tmp / "store"), "metrics_interval": 0})
    path = tmp / "broker.json"
    write_config(path, config)
    if snapshot is not None:
        env: dict[str, str] | None = {**os.environ, "PYTHONPATH": str(snapshot)}
        prefix = [str(VENV_BIN / "python"), "-m", "amqtt_durable.cli", "broker"]
    else:
        env, prefix = None, [str(VENV_BIN / "amqtt-durable"), "broker"]
    return BrokerProcess("ours", [*prefix, "-c", str(path)], port, tmp / "broker.log", Login(), args.broker_cpus, env)


def run_rounds(ctx: Ctx, runs: dict[str, list[Run]], warmups: list[Run]) -> None:
    """The warm-up, then ``--runs`` rounds of every kind, each round starting with the next kind."""
    args = ctx.args
    if args.warmup:
        for kind in args.only:
            log(f"warm-up: {kind}")
            warmups.append(run_receiver(ctx, kind, "warm-up", min(500, args.n), min(100, args.live)))
    for rnd in range(args.runs):
        shift = rnd % len(args.only)
        for kind in args.only[shift:] + args.only[:shift]:
            log(f"round {rnd + 1}: {kind}")
            runs.setdefault(kind, []).append(run_receiver(ctx, kind, f"round {rnd + 1}", args.n, args.live))


def note_code_used(ctx: Ctx, info: dict[str, str], runs: dict[str, list[Run]], *, snapshot: Path | None,
                   watched: dict[str, Path], at_start: dict[str, dict[str, str]]) -> None:
    """Say which SDK copy the receivers imported, and whether the sources changed during the run."""
    sdk_files = {run.res.sdk_module for kind_runs in runs.values() for run in kind_runs
                 if run.res is not None and run.res.sdk_module}
    folders = sorted({str(Path(path).parent.parent) for path in sdk_files})
    info["code"] += f"; the SDK receivers imported durable_client from {', '.join(folders) or '(none ran)'}"
    if snapshot is not None and any(not path.startswith(str(snapshot)) for path in sdk_files):
        ctx.note(f"WARNING: a receiver imported the SDK from outside the snapshot: {sorted(sdk_files)}")
    for name, folder in watched.items():
        if changed := changed_files(at_start[name], source_fingerprint(folder)):
            files = ", ".join(changed)
            ctx.note(f"the {name} source changed in the working tree during the run ({files}); "
                     + ("the run used the copy taken at start" if snapshot else "WARNING: runs may mix versions"))


def run(args: argparse.Namespace, tmp: Path, info: dict[str, str], *, runs: dict[str, list[Run]],
        warmups: list[Run], notes: list[str]) -> None:
    watched = {"plugin": PLUGIN_DIR, "SDK": SDK_DIR, "protocol": PROTOCOL_DIR}
    at_start = {name: source_fingerprint(folder) for name, folder in watched.items()}
    snapshot = None
    if args.code != "live":
        snapshot = snapshot_packages(list(watched.values()), tmp / "snapshot",
                                     git_root=ROOT if args.code == "head" else None)
        sys.path.insert(0, str(snapshot))  # the receiver processes inherit sys.path: they import the SDK copy
    used = at_start if snapshot is None else {
        name: source_fingerprint(snapshot / folder.name) for name, folder in watched.items()}
    digests = ", ".join(f"{name} sha256 {fingerprint_digest(fp)}" for name, fp in used.items())
    where = {"head": "copies of all three as committed in git HEAD, taken at start",
             "worktree": "copies of all three from the working tree, taken at start",
             "live": "the working tree, as it was when each process started"}[args.code]
    info["code"] = f"{digests} of the *.py files; broker and SDK ran from {where}"
    broker = build_broker(args, tmp, snapshot)
    ctx = Ctx(args, broker, tmp / "state", notes)
    differ = [f"{name}: {file}" for name in watched for file in changed_files(used[name], at_start[name])]
    if args.code == "head" and differ:
        ctx.note(f"the working tree differed from git HEAD at the start ({', '.join(differ)}: uncommitted work "
                 "of others); the run used the committed code")
    try:
        log(f"starting the broker: {shlex.join(broker.argv)} (port {broker.port})")
        broker.start(args.startup_timeout)
        run_rounds(ctx, runs, warmups)
        if not broker.alive():
            ctx.note(f"the broker exited unexpectedly; last log line: {broker.last_log_line()!r}")
        note_code_used(ctx, info, runs, snapshot=snapshot, watched=watched, at_start=at_start)
    finally:
        log(f"stopped the broker: {broker.stop(timeout=30.0)}")
        log_tail = broker.log_tail()
        if any(word in log_tail for word in ("Traceback", "ERROR")):
            ctx.note(f"the broker log has errors; its tail:\n{log_tail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "bench/bench_sdk.py", *(sys.argv[1:] if argv is None else argv)])
    info = machine_info()
    try:
        info["packages"] += f", paho-mqtt {version('paho-mqtt')}"
    except PackageNotFoundError:
        info["packages"] += ", paho-mqtt not installed"
    info["git"] = git_revision(ROOT, ["plugin", "client_sdk", "bench", "broker.yaml"])
    info["code"] = "?"
    runs: dict[str, list[Run]] = {}
    warmups: list[Run] = []
    notes: list[str] = []
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_sdk_", args.keep_tmp,
                       lambda tmp: run(args, tmp, info, runs=runs, warmups=warmups, notes=notes), notes.append)
    write_report(render(args, info, command, runs=runs, warmups=warmups, notes=notes, started=started,
                        elapsed=time.perf_counter() - t0), args.out)
    failed = [run for kind_runs in runs.values() for run in kind_runs if run.problems] + [
        run for run in warmups if run.problems]
    complete = all(len(runs.get(kind, [])) == args.runs for kind in args.only)
    if failed or not complete:
        print(f"CORRECTNESS FAILURE in {len(failed)} run(s)" if failed else "INCOMPLETE RUN", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
