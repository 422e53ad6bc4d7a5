"""The broker-bound harness the benchmarks share: the brokers under test (stock amqtt, amqtt-durable,
Mosquitto) with their configs, the run context, the result table and the scenario-a live run.

bench_durable.py is its first user; bench_wildcards.py and bench_storm.py measure with the same
brokers and clients, so their figures compare with its.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    CLIENT_START_S,
    MOSQUITTO,
    OURS,
    PLUGIN_DIR,
    PROTOCOL_DIR,
    RESULT_MARGIN_S,
    STOCK,
    VENV_BIN,
    BrokerProcess,
    listener_config,
    log,
    mosquitto_broker,
    run_publisher,
    snapshot_packages,
    write_config,
    write_password_file,
)
from _rawmqtt import (
    ClientProcess,
    Login,
    PublishResult,
    PubSpec,
    ReceiveResult,
    SubSpec,
    publisher_main,
    session_roundtrip,
    subscriber_main,
)

from amqtt_durable.process import free_port

USERNAME = "bench"


PASSWORD = "bench-password"


Scalar = float | int | str | None


@dataclass
class Runs:
    """One value per repetition of a scenario."""

    values: list[float | int | str] = field(default_factory=list)

    def numbers(self) -> list[float]:
        return [float(v) for v in self.values if isinstance(v, int | float)]

    def median(self) -> float | None:
        nums = self.numbers()
        return statistics.median(nums) if nums else None


Value = Scalar | Runs


@dataclass(frozen=True)
class Target:
    text: str
    check: Callable[[float | None, float | None, argparse.Namespace], bool | None]


def _ratio_at_least(factor: float) -> Target:
    def check(stock: float | None, ours: float | None, _args: argparse.Namespace) -> bool | None:
        if stock is None or ours is None or not stock:
            return None
        return ours / stock >= factor

    return Target(f"ours/stock >= {factor:g}x", check)


def _ours_at_most(limit: float, text: str) -> Target:
    def check(_stock: float | None, ours: float | None, _args: argparse.Namespace) -> bool | None:
        return None if ours is None else ours <= limit

    return Target(text, check)


def _all_survive(_stock: float | None, ours: float | None, args: argparse.Namespace) -> bool | None:
    return None if ours is None else ours >= args.n


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    better: str  # "higher", "lower" or "" (informational)
    scenario: str  # letter the metric belongs to ("" = always shown)
    target: Target | None = None


RSS_TARGET = _ours_at_most(100.0, "ours <= 100 MB")


METRICS: list[Metric] = [
    Metric("startup_empty", "start-up time, empty store (spawn -> CONNACK)", "s", "lower", ""),
    Metric("preflight", "preflight: 10 msgs queued offline, reconnect", "", "", ""),
    Metric("a_rate", "(a) live throughput, durable subscriber, end to end", "msgs/s", "higher", "a",
           _ratio_at_least(1.5)),
    Metric("a_p50", "(a) latency p50", "ms", "lower", "a"),
    Metric("a_p99", "(a) latency p99", "ms", "lower", "a"),
    Metric("a_recv", "(a) received", "", "", "a"),
    Metric("b_rate", "(b) offline enqueue, PUBACKs", "msgs/s", "higher", "b", _ratio_at_least(2.0)),
    Metric("b_routed", "(b) offline enqueue until all routed (first send -> flush marker back)", "msgs/s",
           "higher", "b"),
    Metric("b_acked", "(b) PUBACKed", "", "", "b"),
    Metric("c_rate", "(c) replay on reconnect (CONNECT -> all N)", "msgs/s", "higher", "c", _ratio_at_least(2.0)),
    Metric("c_first", "(c) CONNECT -> first replayed message", "ms", "lower", "c",
           _ours_at_most(10.0, "ours <= 10 ms")),
    Metric("c_recv", "(c) received after reconnect", "", "", "c"),
    Metric("d_survived", "(d) messages delivered after SIGKILL + restart", "msgs", "higher", "d",
           Target("ours 100% (= N), stock 0%", _all_survive)),
    Metric("d_detail", "(d) details", "", "", "d"),
    Metric("e_enq_rate", "(e) big backlog enqueue, PUBACKs", "msgs/s", "higher", "e"),
    Metric("e_enq_time", "(e) big backlog enqueue duration (first send -> last PUBACK)", "s", "lower", "e"),
    Metric("e_routed_time", "(e) big backlog: first send -> all routed (flush marker back)", "s", "lower", "e"),
    Metric("e_rss_idle", "(e) RSS before enqueue", "MB", "lower", "e"),
    Metric("e_rss_enq", "(e) peak RSS during enqueue", "MB", "lower", "e", RSS_TARGET),
    Metric("e_store", "(e) store size on disk", "MB", "", "e"),
    Metric("e_stop", "(e) graceful stop (SIGINT) with the backlog", "", "", "e"),
    Metric("e_startup", "(e) start-up time with backlog (spawn -> CONNACK)", "s", "lower", "e",
           _ours_at_most(3.0, "ours <= 3 s")),
    Metric("e_rss_ready", "(e) peak RSS, restart until CONNACK", "MB", "lower", "e", RSS_TARGET),
    Metric("e_first", "(e) after restart: CONNECT -> first replayed message", "ms", "lower", "e"),
    Metric("e_rss_replay", "(e) peak RSS, restart + replay probe", "MB", "lower", "e", RSS_TARGET),
    Metric("e_probe", "(e) replay of the backlog after restart", "", "", "e"),
]


METRIC_BY_KEY = {m.key: m for m in METRICS}


@dataclass
class Ceiling:
    pub_rates: list[float] = field(default_factory=list)
    sub_rates: list[float] = field(default_factory=list)
    n: int = 0
    error: str | None = None


@dataclass
class Results:
    values: dict[str, dict[str, Value]] = field(default_factory=lambda: {STOCK: {}, OURS: {}, MOSQUITTO: {}})
    notes: list[str] = field(default_factory=list)
    ceiling: Ceiling = field(default_factory=Ceiling)

    def set(self, broker: str, key: str, value: Scalar) -> None:
        if key not in METRIC_BY_KEY:
            raise KeyError(key)
        self.values[broker][key] = value

    def add(self, broker: str, key: str, value: float | int | str | None) -> None:
        """Record one repetition's value (None = not measured in this run)."""
        if key not in METRIC_BY_KEY:
            raise KeyError(key)
        runs = self.values[broker].setdefault(key, Runs())
        if not isinstance(runs, Runs):
            raise TypeError(key)
        runs.values.append("—" if value is None else value)

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)


@dataclass
class Ctx:
    args: argparse.Namespace
    tmp: Path
    login: Login
    results: Results
    brokers: dict[str, BrokerProcess]
    store_dir: Path | None
    client_cpus: tuple[int, ...] | None
    counter: int = 0

    def tag(self) -> bytes:
        self.counter += 1
        return os.urandom(2) + self.counter.to_bytes(2, "big")

    def ids(self, scenario: str, broker: str, tag: bytes) -> tuple[str, str, str]:
        suffix = f"{scenario}-{broker}-{tag.hex()}"
        return f"bench/{suffix}", f"sub-{suffix}", f"pub-{suffix}"


def start_publisher(ctx: Ctx, b: BrokerProcess, *, pub_id: str, topic: str, tag: bytes, n: int, timeout: float,
                    progress: float = 0.0, qos: int = 1) -> ClientProcess:
    spec = PubSpec(b.port, pub_id, ctx.login, topic, tag, n, ctx.args.inflight, timeout, progress, ctx.client_cpus,
                   flush_topic=f"bench-flush/{pub_id}", qos=qos)
    return ClientProcess(f"{b.name} publisher", publisher_main, spec)


def sub_spec(ctx: Ctx, b: BrokerProcess, *, sub_id: str, tag: bytes, n: int, timeout: float, clean: bool = False,
             subscribe: str | None = None, idle: float | None = None, need_session: bool = False,
             after_first: float | None = None, record_latency: bool = False, qos: int = 1) -> SubSpec:
    return SubSpec(b.port, sub_id, ctx.login, clean, tag, n, timeout, idle=idle, subscribe=subscribe,
                   need_session=need_session, after_first=after_first, record_latency=record_latency,
                   cpus=ctx.client_cpus, qos=qos)


def drop_session(ctx: Ctx, b: BrokerProcess, sub_id: str, timeout: float = 30.0) -> None:
    try:
        session_roundtrip(b.port, sub_id, ctx.login, clean=True, topic=None, timeout=timeout)
    except Exception as exc:
        ctx.results.note(f"{b.name}: could not drop session {sub_id}: {exc}")


def live_run(ctx: Ctx, b: BrokerProcess, *, scenario: str, n: int, clean: bool,
             record_latency: bool, qos: int = 1) -> tuple[PublishResult, ReceiveResult, str]:
    """Subscriber process subscribed (at ``qos``), publisher process publishes n (at ``qos``); both run to
    completion."""
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids(scenario, b.name, tag)
    spec = sub_spec(ctx, b, sub_id=sub_id, tag=tag, n=n, timeout=ctx.args.timeout + RESULT_MARGIN_S, clean=clean,
                    subscribe=topic, idle=ctx.args.idle, record_latency=record_latency, qos=qos)
    with (ClientProcess(f"{b.name} subscriber", subscriber_main, spec) as sub,
          start_publisher(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=ctx.args.timeout,
                          qos=qos) as pub):
        sub.expect("ready", CLIENT_START_S)
        pr = run_publisher(pub, ctx.args.timeout)
        if pr.flush_error:
            ctx.results.note(f"{b.name}: publisher {pub_id}: {pr.flush_error}")
        res: ReceiveResult = sub.expect("result", spec.timeout + RESULT_MARGIN_S)
    return pr, res, sub_id


def live_rate(pr: PublishResult, res: ReceiveResult) -> float | None:
    """End-to-end msgs/s of a live run: the publisher's first send to the subscriber's last new message."""
    if res.unique and res.t_last_ns > pr.t_first_send_ns:
        return res.unique / ((res.t_last_ns - pr.t_first_send_ns) / 1e9)
    return None


def warmup(ctx: Ctx, b: BrokerProcess) -> None:
    live_run(ctx, b, scenario="warm", n=500, clean=True, record_latency=False)


def build_brokers(args: argparse.Namespace, tmp: Path, ours_settings: dict[str, object] | None = None, *,
                  mosquitto: str | None = None) -> tuple[dict[str, BrokerProcess], Path | None]:
    """Stock and our broker (and Mosquitto when ``mosquitto`` names its executable);
    ``ours_settings`` adds or overrides plugin settings of ours."""
    pw_file = tmp / "passwords.txt"
    write_password_file(pw_file, USERNAME, PASSWORD)
    login = Login(USERNAME, PASSWORD)
    cpus = args.broker_cpus if args.pin else None
    stock_plugins = {
        "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False},
        "amqtt.plugins.authentication.FileAuthPlugin": {"password_file": str(pw_file)},
    }
    brokers: dict[str, BrokerProcess] = {}

    stock_port = free_port()
    stock_cfg = tmp / "stock.yaml"
    write_config(stock_cfg, {"listeners": listener_config(stock_port), "plugins": stock_plugins})
    brokers[STOCK] = BrokerProcess(STOCK, [str(VENV_BIN / "amqtt"), "-c", str(stock_cfg)], stock_port,
                                   tmp / "stock.log", login, cpus)

    store: Path | None = None
    if args.ours_standin:
        ours_port = free_port()  # not stock_port: free_port hands out every other port of its block before one again
        ours_cfg = tmp / "ours.yaml"
        write_config(ours_cfg, {"listeners": listener_config(ours_port), "plugins": stock_plugins})
        brokers[OURS] = BrokerProcess(OURS, [str(VENV_BIN / "amqtt"), "-c", str(ours_cfg)], ours_port,
                                      tmp / "ours.log", login, cpus)
    else:
        code = snapshot_packages([PLUGIN_DIR, PROTOCOL_DIR], tmp / "snapshot") if args.snapshot else None
        brokers[OURS], store = durable_broker(args, tmp, OURS, ours_settings, code=code)
    if mosquitto is not None:
        brokers[MOSQUITTO] = mosquitto_broker(mosquitto, tmp / "mosquitto", free_port(), login,
                                              max_queued=max(2_000_000, 2 * args.big), cpus=cpus)
    return brokers, store


def durable_broker(args: argparse.Namespace, tmp: Path, name: str, settings: dict[str, object] | None = None, *,
                   code: Path | None = None) -> tuple[BrokerProcess, Path]:
    """amqtt-durable as ``name`` (config, log and store named after it in ``tmp``), with its store; run by
    --ours-cmd, else from ``code`` (package copies: a snapshot, or another revision's), else the installed
    command. ``settings`` adds or overrides plugin settings."""
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    store = tmp / ("store" if name == OURS else f"{name}-store")
    depth = max(2_000_000, 2 * args.big)
    write_config(cfg, {
        "listeners": listener_config(port),
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            "amqtt_durable.DurableSessionsPlugin": {
                "store": str(store),
                "max_depth": depth,
                "max_depth_disconnected": depth,
                "recovery_buffer": 100,
                "session_expiry": 3600,
                **(settings or {}),
            },
        },
    })
    env: dict[str, str] | None = None
    if args.ours_cmd:
        prefix = shlex.split(args.ours_cmd)
    elif code is not None:
        # PYTHONPATH comes before the editable install's .pth entry, so the copy is what gets imported
        env = {**os.environ, "PYTHONPATH": str(code)}
        prefix = [str(VENV_BIN / "python"), "-m", "amqtt_durable.cli", "broker"]
    else:
        prefix = [str(VENV_BIN / "amqtt-durable"), "broker"]
    cpus = args.broker_cpus if args.pin else None
    return BrokerProcess(name, [*prefix, "-c", str(cfg)], port, tmp / f"{name}.log", Login(USERNAME, PASSWORD),
                         cpus, env), store


def plugin_source_dir(args: argparse.Namespace, tmp: Path) -> Path:
    """The amqtt_durable folder our broker imports: the snapshot copy, or the working tree."""
    snap = tmp / "snapshot" / PLUGIN_DIR.name
    return snap if args.snapshot and snap.is_dir() else PLUGIN_DIR


def fmt_runs(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:,.0f}"
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
