"""An eleventh pass of black-box tests written from README.md, docs/sdk.md, docs/streams.md and
docs/guarantees.md alone, and from the docstrings of the examples the README names: promises earlier
rounds left open. Real broker processes on 127.0.0.1 (ephemeral ports, tmp stores), raw sockets, paho and
SDK clients; each test quotes the promise it checks.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import raw_connect, read_packet

from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, readme_example
from durable_client import AsyncDurableClient, DurableClient, Event, Marker, WrongTypeError

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=4 * WAIT, check=False, cwd=ROOT
    )


# ------------------------------------------------------------------------------- README: the examples


def test_dashboard_back_after_a_restart_gets_no_retained_initial_values_and_an_empty_cache_at_the_marker(
    broker_factory: Callable[..., Broker],
) -> None:
    """README: "examples/dashboard.py: replayed vs live readings and the last-value cache (SDK)"; its
    docstring, step 4: the dashboard back with the same client id finds its subscription in the broker's
    session, so (sdk.md) "a restarted client re-sends only the subscriptions its broker session lacks (a
    repeated SUBSCRIBE would queue retained values again)": no retained initial values come again, the
    replayed readings do not enter the cache, so it is empty at the marker until live readings arrive."""
    broker = broker_factory()
    result = run_script(ROOT / "examples" / "dashboard.py", "--port", str(broker.port), "--readings", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "marker (on_live) after 6 replayed events: 6 readings + 0 retained initial values" in out, out
    at_marker = out.split("back (session_present=1)", 1)[1].split("cache at the marker:", 1)[1]
    assert at_marker.splitlines()[2].strip() == "(empty)", out
    doc = (ROOT / "examples" / "dashboard.py").read_text().split('"""')[1]
    assert "sends the retained readings again" not in doc, "the docstring promises initial values again"


# ------------------------------------------------------------------ sdk.md: Subscriptions, reconnection


class Got:
    """Events a listener got, waited on by condition."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait(self, predicate: Callable[[list[Event]], bool]) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.events), WAIT)

    def topics(self) -> list[str]:
        with self._cond:
            return [e.topic for e in self.events]


def test_subscribe_again_replaces_the_listener_none_included_and_sends_a_subscribe_only_for_a_new_qos(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: "`subscribe(...)`: one listener per filter: calling it again for a filter it holds changes
    that subscription's QoS, durability and listener (the new `listener`, `None` included, replaces the
    old; a SUBSCRIBE goes out again only for a new QoS)". A SUBSCRIBE is seen by the retained message it
    sends again (guarantees.md: "the retained messages it matches are sent again, at that QoS"), queued
    before the live message published after it; a session's messages come in order, so a probe on
    another filter published last shows what came before it."""
    broker = broker_factory()
    publisher = clients(broker.port, "p-relisten", clean_session=True)
    publisher.publish("a/x", [b"seed"], qos=1, retain=True)
    first, second, third, probe = Got(), Got(), Got(), Got()
    client = sdk(broker.port, "relisten")
    client.subscribe("b/#", qos=1, listener=probe)
    client.subscribe("a/#", qos=1, listener=first)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert first.wait(lambda es: [e.topic for e in es] == ["a/x"]) and first.events[0].retained

    client.subscribe("a/#", qos=1, listener=second)  # same QoS: no SUBSCRIBE, so no retained a/x again
    publisher.publish("a/y", [b"live"])
    assert second.wait(lambda es: len(es) >= 1)
    publisher.publish("b/1", [b"probe"])
    assert probe.wait(lambda es: len(es) >= 1)
    assert second.topics() == ["a/y"] and first.topics() == ["a/x"]

    client.subscribe("a/#", qos=1, listener=None)  # None replaces the listener: a/z goes to no one
    publisher.publish("a/z", [b"unheard"])
    publisher.publish("b/2", [b"probe"])
    assert probe.wait(lambda es: len(es) >= 2)
    assert second.topics() == ["a/y"] and first.topics() == ["a/x"]

    client.subscribe("a/#", qos=0, listener=third)  # a new QoS: a SUBSCRIBE, the retained a/x again at 0
    publisher.publish("a/w", [b"at0"], qos=1)
    assert third.wait(lambda es: len(es) >= 2)
    assert [(e.topic, e.retained, e.qos) for e in third.events] == [("a/x", True, 0), ("a/w", False, 0)]


# ----------------------------------------------------------------------- sdk.md / streams.md: signatures


def params(function: Callable[..., object]) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter but ``self``."""
    return [
        (p.name, p.kind.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"
    ]


KW = "KEYWORD_ONLY"
POS = "POSITIONAL_OR_KEYWORD"
NONE = inspect.Parameter.empty


def test_the_threaded_client_s_methods_take_the_documented_arguments_and_defaults() -> None:
    """sdk.md and streams.md give each signature: `subscribe(topic_filter, qos=1, *, durable=True,
    listener=None, timeout=10.0)`, `client.subscribe_stream("telemetry/#", listener, *, window=None,
    after=None, timeout=10.0)` ("the options keyword-only"), `client.stream_info(topic_filter="#", *,
    timeout=10.0)`, `publish(topic, payload, qos=1, retain=False, *, timeout=10.0)`,
    `unsubscribe(topic_filter)` ("no `timeout`"), `close(keep_session=True)` with `close(timeout=...)`,
    `cache.get(topic, default=None)`; `DurableClient(client_id, host="127.0.0.1", port=1883, ...)`,
    `keepalive` "(default 30)", `reconnect_min_delay` (0.1 s) and `reconnect_max_delay` (30 s)."""
    assert params(DurableClient.subscribe) == [
        ("topic_filter", POS, NONE),
        ("qos", POS, 1),
        ("durable", KW, True),
        ("listener", KW, None),
        ("timeout", KW, 10.0),
    ]
    assert params(DurableClient.subscribe_stream) == [
        ("topic_filter", POS, NONE),
        ("listener", POS, NONE),
        ("window", KW, None),
        ("after", KW, None),
        ("timeout", KW, 10.0),
    ]
    assert params(DurableClient.stream_info) == [("topic_filter", POS, "#"), ("timeout", KW, 10.0)]
    assert params(DurableClient.publish) == [
        ("topic", POS, NONE),
        ("payload", POS, NONE),
        ("qos", POS, 1),
        ("retain", POS, False),
        ("timeout", KW, 10.0),
    ]
    assert params(DurableClient.unsubscribe) == [("topic_filter", POS, NONE)]
    close = {name: default for name, _kind, default in params(DurableClient.close)}
    assert close["keep_session"] is True and "timeout" in close
    init = {name: (kind, default) for name, kind, default in params(DurableClient)}
    assert list(init)[:3] == ["client_id", "host", "port"]
    assert (init["host"][1], init["port"][1]) == ("127.0.0.1", 1883)
    assert (init["keepalive"][1], init["reconnect_min_delay"][1], init["reconnect_max_delay"][1]) == (30, 0.1, 30)
    assert params(DurableClient("sig").cache.get) == [("topic", POS, NONE), ("default", POS, None)]


def test_the_async_client_s_coroutines_take_no_timeout_and_no_listener() -> None:
    """sdk.md, asyncio: "`subscribe`, `subscribe_stream`, `unsubscribe`, `publish`, `stream_info`, `connect`
    and `close(keep_session=...)` are coroutines ... so none takes a `timeout`, and none takes a listener
    ...: `subscribe(topic_filter, qos=1, *, durable=True)`, `subscribe_stream(topic_filter, *, window=None,
    after=None)`, `unsubscribe(topic_filter)`, `publish(topic, payload, qos=1, retain=False)`,
    `stream_info(topic_filter="#")`, `connect()`, `close(keep_session=True)`. `ready_for_events()` and
    `live()` are coroutines too ..., and `events()` is not"; `request_timeout` (10 s)."""
    expected = {
        "subscribe": [("topic_filter", POS, NONE), ("qos", POS, 1), ("durable", KW, True)],
        "subscribe_stream": [("topic_filter", POS, NONE), ("window", KW, None), ("after", KW, None)],
        "unsubscribe": [("topic_filter", POS, NONE)],
        "publish": [("topic", POS, NONE), ("payload", POS, NONE), ("qos", POS, 1), ("retain", POS, False)],
        "stream_info": [("topic_filter", POS, "#")],
        "connect": [],
        "close": [("keep_session", POS, True)],
        "ready_for_events": [],
        "live": [],
    }
    for name, signature in expected.items():
        method = getattr(AsyncDurableClient, name)
        assert params(method) == signature, name
        assert inspect.iscoroutinefunction(method), f"{name} is a coroutine"
    assert params(AsyncDurableClient.events) == [] and not inspect.iscoroutinefunction(AsyncDurableClient.events)
    assert inspect.signature(AsyncDurableClient).parameters["request_timeout"].default == 10


# ------------------------------------------------------------------ guarantees.md: delivered QoS


def publishes_until(
    sock: socket.socket, done: Callable[[list[tuple[str, int, bool, bytes]]], bool]
) -> list[tuple[str, int, bool, bytes]]:
    """(topic, QoS, RETAIN, payload) of the PUBLISHes the broker sends until ``done`` holds for them (at most
    100; each read bounded by the socket's timeout); QoS 1 ones are acknowledged."""
    got: list[tuple[str, int, bool, bytes]] = []
    for _ in range(100):
        if done(got):
            return got
        first, body = read_packet(sock)
        if first >> 4 != 3:
            continue
        length = int.from_bytes(body[:2], "big")
        topic, rest = body[2 : 2 + length].decode(), body[2 + length :]
        qos = (first >> 1) & 3
        if qos:
            sock.sendall(bytes((0x40, 2)) + rest[:2])
            rest = rest[2:]
        got.append((topic, qos, bool(first & 1), rest))
    raise AssertionError(f"not done after 100 PUBLISHes: {got}")


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_retained_message_comes_once_per_matching_filter_of_a_subscribe_at_each_filter_s_qos(
    either_reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """guarantees.md, Delivered QoS: "A retained message sent because of a SUBSCRIBE ... comes once per filter
    of the SUBSCRIBE that matches it, at the lower of that filter's QoS and its own, durable and clean sessions
    alike (a SUBSCRIBE of `a/#` at QoS 0 and `a/b` at QoS 1 gets a retained `a/b` stored at QoS 1 or 2 twice,
    at QoS 0 and 1, and one stored at QoS 0 twice at QoS 0)"; "Only retained messages sent because of a new
    SUBSCRIBE carry RETAIN=1". A live message published after the SUBACK, once it came, shows no further
    copy was on its way (a durable session's queue is in order; a clean one's retained copies go at the
    SUBSCRIBE)."""
    broker = either_reader
    publisher = clients(broker.port, f"ret-pub-{clean}", clean_session=True)
    publisher.publish("q1/b", [b"kept at 1"], qos=1, retain=True)
    publisher.publish("q2/b", [b"kept at 2"], qos=2, retain=True)
    publisher.publish("q0/b", [b"kept at 0"], qos=0, retain=True)
    sock = raw_connect(broker.port, f"ret-sub-{clean}", clean=clean)
    try:
        filters = [("q1/#", 0), ("q1/b", 1), ("q2/#", 0), ("q2/b", 1), ("q0/#", 0), ("q0/b", 1)]
        sock.sendall(mqtt_packet(0x82, b"\x00\x09" + b"".join(mqtt_string(f) + bytes((q,)) for f, q in filters)))
        got = publishes_until(sock, lambda ps: sum(p[2] for p in ps) >= 6)
        publisher.publish("q0/z", [b"live"], qos=1)
        got += publishes_until(sock, lambda ps: any(p[0] == "q0/z" for p in ps))
        copies = sorted((topic, qos, payload) for topic, qos, retain, payload in got if retain)
        assert copies == [
            ("q0/b", 0, b"kept at 0"),
            ("q0/b", 0, b"kept at 0"),
            ("q1/b", 0, b"kept at 1"),
            ("q1/b", 1, b"kept at 1"),
            ("q2/b", 0, b"kept at 2"),
            ("q2/b", 1, b"kept at 2"),
        ], got
        assert [p for p in got if not p[2]] == [("q0/z", 0, False, b"live")], got
    finally:
        sock.close()


def test_a_listener_raising_on_a_qos0_event_is_logged_as_error_its_other_listeners_run_and_the_connection_stays(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md: "This holds for QoS 1 events: QoS 0 ones are gone once sent, so a listener that raises on an
    event delivered at QoS 0 is logged (ERROR) and the connection is kept: the event's other listeners
    still run, and dropping the connection would only lose the QoS 0 events sent while the client
    reconnects." (Published at QoS 1, delivered at QoS 0 by QoS 0 subscriptions.)"""
    broker = broker_factory()
    raised, other = Got(), Got()
    disconnects: list[str] = []

    def failing(event: Event) -> None:
        raised(event)
        raise RuntimeError("on purpose")

    client = sdk(broker.port, "q0-raise", on_disconnected=disconnects.append)
    client.subscribe("z/#", qos=0, listener=failing)
    client.subscribe("z/+", qos=0, listener=other)
    probe = Got()
    client.subscribe("y/#", qos=1, listener=probe)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        publisher = clients(broker.port, "q0-raise-pub", clean_session=True)
        publisher.publish("z/a", [b"one", b"two"], qos=1)
        publisher.publish("y/1", [b"after"], qos=1)  # handled on the same thread after both, their logs done
        assert probe.wait(lambda es: len(es) >= 1)
    assert [(e.payload, e.qos) for e in other.events] == [(b"one", 0), (b"two", 0)], "the other listener ran"
    assert [e.payload for e in raised.events] == [b"one", b"two"], "not called again: the event cannot come again"
    assert client.connected and not disconnects and client.stats.reconnects == 0, "the connection was kept"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("durable_client")]
    assert len(errors) == 2, [r.getMessage() for r in caplog.records]


def test_the_readme_asyncio_example_prints_each_reading_as_it_comes(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """README, The SDK: the asyncio example (`AsyncDurableClient("dashboard-2", "127.0.0.1", 1883,
    persistence="disk", state_dir="./state")`, `async for event in events: print(event.topic, event.payload,
    "replayed" if event.replayed else "live")`) runs as written: each reading published to
    sensors/+/temperature is printed once, in order; its marks live under ./state/dashboard-2/."""
    broker = broker_factory()
    script = readme_example("For asyncio code", broker.port, tmp_path)
    publisher = clients(broker.port, "readme-async-pub", clean_session=True)
    child = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    try:
        assert child.stdout is not None
        out = child.stdout.fileno()
        data = b""

        def lines_within(timeout: float) -> list[str]:
            """The complete lines printed so far, after reading what comes within ``timeout``."""
            nonlocal data
            if select.select([out], [], [], timeout)[0]:
                data += os.read(out, 65536)
            return [line.decode() for line in data.split(b"\n")[:-1]]

        # Until the example has subscribed, a reading reaches no one: publish until one is printed.
        lines: list[str] = []
        for attempt in range(60):
            publisher.publish("sensors/1/temperature", [f"probe-{attempt}".encode()])
            if lines := lines_within(0.5):
                break
        assert lines, "the example printed no reading"
        publisher.publish("sensors/2/temperature", [b"21.5", b"21.6"])
        for _ in range(100):
            if lines[-1].startswith("sensors/2/temperature b'21.6'"):
                break
            lines = lines_within(WAIT)
        assert lines[-2:] == ["sensors/2/temperature b'21.5' live", "sensors/2/temperature b'21.6' live"], lines
        assert lines[0].startswith("sensors/1/temperature b'probe-") and lines[0].split()[-1] in ("live", "replayed")
        assert (tmp_path / "state" / "dashboard-2").is_dir()
    finally:
        child.kill()
        child.communicate(timeout=WAIT)


# --------------------------------------------------------------------------------- sdk.md: Bad input


@pytest.mark.parametrize(
    ("option", "call"),
    [
        ("session_expiry", lambda flag: DurableClient("flag-secs", session_expiry=flag)),
        ("reconnect_min_delay", lambda flag: DurableClient("flag-secs", reconnect_min_delay=flag)),
        ("reconnect_max_delay", lambda flag: DurableClient("flag-secs", reconnect_max_delay=flag)),
        ("fsync_delay_ms", lambda flag: DurableClient("flag-secs", fsync_delay_ms=flag)),
        ("timeout", lambda flag: DurableClient("flag-secs").publish("a", b"", timeout=flag)),
        ("timeout", lambda flag: DurableClient("flag-secs").connect(timeout=flag)),
        ("request_timeout", lambda flag: AsyncDurableClient("flag-secs", request_timeout=flag)),
    ],
)
@pytest.mark.parametrize("flag", [True, False])
def test_true_and_false_are_no_number_of_seconds(option: str, call: Callable[[bool], object], flag: bool) -> None:
    """sdk.md, Bad input: "seconds may be any real number but `True`/`False` (`int`, `float`, `Fraction`,
    numpy ...)"; "A value of the wrong *type* raises `WrongTypeError`" whose message starts with the
    option's name. (A bool is a `numbers.Real` to Python: the exception has to be said.)"""
    with pytest.raises(WrongTypeError, match=rf"^{option} must be a finite number of \w+, .*got {flag}$"):
        call(flag)


def test_under_a_lower_interpreter_digit_limit_an_integer_past_it_is_shown_in_bits_and_after_names_the_limit() -> None:
    """sdk.md, Bad input: "where `sys.set_int_max_str_digits()` sets a lower limit it counts to that one: an
    integer past it is shown as its size in bits, and a refused `after` id names the limit, `of at most 640
    digits`"."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        with pytest.raises(ValueError) as refused:
            DurableClient("digits-640", port=10**640)
        assert str(refused.value) == "port must be a whole number from 1 to 65535, got an integer of 2127 bits"
        client = DurableClient("digits-640")
        with pytest.raises(ValueError, match=r"^after: .* of at most 640 digits, got an integer of 2127 bits$"):
            client.subscribe_stream("t/#", lambda _event: None, after={"t/a": 10**640})
        client.subscribe_stream("t/#", lambda _event: None, after={"t/a": 10**639})  # 640 digits: taken
    finally:
        sys.set_int_max_str_digits(before)


# ----------------------------------------------------------------------------- sdk.md: asyncio


def test_the_sdk_page_s_asyncio_example_acknowledges_stop_so_the_next_connection_gets_only_what_followed(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """sdk.md, asyncio: the example `consume()` (`async with AsyncDurableClient("worker-1", ...,
    persistence="disk", state_dir="./state")`, `subscribe("jobs/#", qos=1)`, `ready_for_events()`, `async with
    client.events() as events: async for event in events: await handle(event) ... if event.payload == b"stop":
    break  # "stop" is acknowledged too`); leaving `async with AsyncDurableClient` closes it keeping the
    session. The jobs before and at "stop" are acknowledged: the session's next connection is replayed only
    the job published after it (its marker counts 1)."""
    broker = broker_factory()
    handled: list[bytes] = []

    async def handle(event: Event) -> None:
        handled.append(event.payload)

    state = str(tmp_path / "state")
    publisher = clients(broker.port, "jobs-publisher", clean_session=True)

    async def consume() -> None:
        async with AsyncDurableClient(
            "worker-1", "127.0.0.1", broker.port, persistence="disk", state_dir=state
        ) as client:
            await client.subscribe("jobs/#", qos=1)
            await client.ready_for_events()
            await asyncio.to_thread(publisher.publish, "jobs/1", [b"a", b"b", b"stop", b"after"])
            async with client.events() as events:
                async for event in events:
                    await handle(event)
                    if event.payload == b"stop":
                        break

    async def come_back() -> tuple[Marker, list[bytes]]:
        async with AsyncDurableClient(
            "worker-1", "127.0.0.1", broker.port, persistence="disk", state_dir=state
        ) as client:

            async def end_after_the_marker() -> Marker:
                marker = await client.live()
                await asyncio.to_thread(publisher.publish, "jobs/1", [b"end"])
                return marker

            await client.subscribe("jobs/#", qos=1)
            await client.ready_for_events()
            live = asyncio.create_task(end_after_the_marker())
            got: list[bytes] = []
            async with client.events() as events:
                async for event in events:
                    got.append(event.payload)
                    if event.payload == b"end":
                        break
            return await live, got

    asyncio.run(asyncio.wait_for(consume(), 2 * WAIT))
    assert handled == [b"a", b"b", b"stop"]
    marker, got = asyncio.run(asyncio.wait_for(come_back(), 2 * WAIT))
    assert got == [b"after", b"end"] and marker.replayed == 1, (marker, got)
