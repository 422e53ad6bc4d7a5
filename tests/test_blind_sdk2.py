"""More black-box tests written from README.md and docs/ alone (sdk.md, streams.md, protocol.md,
delivery-log.md), for promises test_blind_sdk.py, test_blind_core.py and test_blind_guarantees.py
leave out: each test quotes the promise it checks (by its words, not a line number) and runs it
against real brokers, real SDK and paho clients over TCP to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from test_blind_sdk import LogWatch, Seen, ctl
from test_hostile_wire import wait_until
from test_sdk import Recorder

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, payloads
from durable_client import (
    AsyncDurableClient,
    ConnectFailed,
    DurableClient,
    DurableClientError,
    Event,
    EventNotProcessedError,
    Marker,
    RequestTimeout,
    Unconnected,
)

pytestmark = pytest.mark.timeout(120)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def code_block_after(page: Path, heading: str, language: str = "python") -> str:
    """The first ``language`` code block after ``heading`` on a docs page, as written."""
    text = page.read_text()
    start = text.index(heading)
    match = re.search(rf"```{language}\n(.*?)```", text[start:], re.S)
    assert match, f"no {language} block after {heading!r} in {page.name}"
    return match.group(1)


def seen_client(sdk: Callable[..., DurableClient], port: int, client_id: str, seen: Seen, **kw: Any) -> DurableClient:
    return sdk(port, client_id, on_live=seen.on_live, on_connected=seen.on_connected,
               on_disconnected=seen.on_disconnected, **kw)


# ------------------------------------------------------------------------------ sdk.md: asyncio


def test_the_asyncio_reference_snippet_runs_as_written_and_acknowledges_stop_too(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """sdk.md, asyncio: the `consume()` example, run as written (its port and state folder
    pointed at the test's): `await handle(event)  # acknowledged once this body finishes`,
    `break  # "stop" is acknowledged too`."""
    state = tmp_path / "state"
    source = code_block_after(DOCS / "sdk.md", "## asyncio")
    source = source.replace("1883", str(broker.port)).replace('"./state"', repr(str(state)))
    # The session exists (a first run subscribed), so what is published now is queued for it.
    first = sdk(broker.port, "worker-1", persistence="disk", state_dir=state)
    first.subscribe("jobs/#", qos=1)
    first.connect(timeout=WAIT)
    first.close(keep_session=True)
    clients(broker.port, "pub", clean_session=True).publish("jobs/a", [b"job-1", b"job-2", b"stop", b"after"])

    handled: list[bytes] = []

    async def handle(event: Event) -> None:
        handled.append(event.payload)

    namespace: dict[str, Any] = {"handle": handle}
    exec(compile(source, "sdk.md", "exec"), namespace)
    asyncio.run(asyncio.wait_for(namespace["consume"](), WAIT))
    assert handled == [b"job-1", b"job-2", b"stop"]

    seen, again = Seen(), Recorder()
    second = seen_client(sdk, broker.port, "worker-1", seen, persistence="disk", state_dir=state)
    second.subscribe("jobs/#", qos=1, listener=again)
    second.connect(timeout=WAIT)
    second.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    assert again.payloads() == [b"after"], "stop (and what came before it) was acknowledged"
    assert seen.markers[0].replayed == 1


def test_an_async_body_that_raises_is_logged_at_info_as_an_event_not_processed(
    broker: Broker, clients: Callable[..., Client], caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md Errors: `EventNotProcessedError` (never raised into your code: what an
    `AsyncDurableClient` logs, at INFO, for an event its loop did not finish, which comes again)."""
    done: list[bytes] = []

    async def run() -> None:
        async with AsyncDurableClient("blind2-notprocessed", HOST, broker.port, reconnect_min_delay=0.05,
                                      reconnect_max_delay=0.5) as client:
            await client.subscribe("np/#", qos=1)
            await client.ready_for_events()
            clients(broker.port, "pub", clean_session=True).publish("np/a", [b"one", b"two"])
            failed = False
            async with client.events() as events:
                async for event in events:
                    if event.payload == b"one" and not failed:
                        failed = True
                        raise_in_body()
                    done.append(event.payload)
                    if event.payload == b"two":
                        break

    def raise_in_body() -> None:
        raise RuntimeError("body failed (on purpose)")

    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="on purpose"):
        asyncio.run(asyncio.wait_for(run(), WAIT))
    assert done == []
    # The failed body's exception reaches the program; what the client logs names the event it did not finish.
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert any(
        (r.exc_info is not None and isinstance(r.exc_info[1], EventNotProcessedError))
        or "EventNotProcessedError" in r.getMessage()
        for r in infos
    ), [r.getMessage() for r in infos]

    async def again() -> list[bytes]:
        got: list[bytes] = []
        async with AsyncDurableClient("blind2-notprocessed", HOST, broker.port) as client:
            await client.subscribe("np/#", qos=1)
            await client.ready_for_events()
            async with client.events() as events:
                async for event in events:
                    got.append(event.payload)
                    if event.payload == b"two":
                        break
        return got

    assert asyncio.run(asyncio.wait_for(again(), WAIT)) == [b"one", b"two"], "the event not finished comes again"


def test_async_live_returns_the_marker_after_the_replay_and_on_live_runs_on_the_loop(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: `await client.live()` returns the replay marker once every queued event was
    processed; await it in another task than the loop that processes the events ... `on_live`
    is called then, on the event loop; `ready_for_events()` ... returns at once."""
    setup = sdk(broker.port, "blind2-live")
    setup.subscribe("lv/#")
    setup.connect(timeout=WAIT)
    setup.close(keep_session=True)
    clients(broker.port, "pub", clean_session=True).publish("lv/a", payloads(3))
    called: list[tuple[Marker, int]] = []

    async def run() -> tuple[Marker, list[bytes], int, int]:
        loop_thread = threading.get_ident()
        processed: list[bytes] = []
        client = AsyncDurableClient("blind2-live", HOST, broker.port,
                                    on_live=lambda marker: called.append((marker, threading.get_ident())))
        async with client:
            await client.subscribe("lv/#")
            await asyncio.wait_for(client.ready_for_events(), 1.0)
            processed_when_live: list[int] = []

            async def consume() -> None:
                async with client.events() as events:
                    async for event in events:
                        processed.append(event.payload)
                        if len(processed) == 3:
                            break

            consumer = asyncio.create_task(consume())
            marker = await asyncio.wait_for(client.live(), WAIT)
            processed_when_live.append(len(processed))
            await asyncio.wait_for(consumer, WAIT)
        return marker, processed, processed_when_live[0], loop_thread

    marker, processed, when_live, loop_thread = asyncio.run(asyncio.wait_for(run(), 2 * WAIT))
    assert processed == payloads(3)
    assert marker.replayed == 3 and when_live == 3, "the marker comes after every replayed event was processed"
    assert len(called) == 1 and called[0][0].replayed == 3 and called[0][1] == loop_thread


# ------------------------------------------------------------------------- sdk.md: subscriptions


def test_subscribing_a_held_filter_again_goes_out_again_only_for_a_new_qos(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: calling [subscribe] again for a filter it holds changes that subscription's QoS,
    durability and listener (the new `listener` ... replaces the old; a SUBSCRIBE goes out again
    only for a new QoS); a repeated SUBSCRIBE would queue retained values again."""
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rs/a", [b"retained"], retain=True)
    first, second = Recorder(), Recorder()
    client = sdk(broker.port, "blind2-resub")
    client.subscribe("rs/#", qos=1, listener=first)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert [e.payload for e in first.wait(1)] == [b"retained"]

    client.subscribe("rs/#", qos=1, listener=second)  # same QoS: only the listener changes
    publisher.publish("rs/b", [b"live-1"])
    assert [e.payload for e in second.wait(1)] == [b"live-1"], "no retained value queued again"
    assert first.payloads() == [b"retained"], "the new listener replaced the old"

    client.subscribe("rs/#", qos=0, listener=second)  # a new QoS: the SUBSCRIBE goes out again
    assert second.wait_until(lambda events: b"retained" in [e.payload for e in events])
    assert [e.payload for e in second.events] == [b"live-1", b"retained"]


def test_one_function_given_for_two_matching_filters_is_called_twice(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: an event goes to the listener of every subscription whose filter matches its topic
    (one function given for two matching filters is called twice)."""
    recorder = Recorder()
    client = sdk(broker.port, "blind2-twice")
    client.subscribe("tw/#", listener=recorder)
    client.subscribe("tw/+", listener=recorder)
    client.subscribe("other/#", listener=recorder)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    clients(broker.port, "pub", clean_session=True).publish("tw/a", [b"once"])
    events = recorder.wait(2)
    assert [e.payload for e in events] == [b"once", b"once"]
    assert events[0].seq == events[1].seq, "one event, two listeners' calls"


def test_a_non_durable_subscription_is_subscribed_again_after_a_reconnect(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: `durable=False` ... is dropped by the broker when the connection ends, so nothing
    is queued for it while away; the client subscribes it again on reconnect."""
    seen, recorder = Seen(), Recorder()
    client = seen_client(sdk, broker.port, "blind2-nondurable", seen)
    client.subscribe("nd/#", durable=False, listener=recorder)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    broker.restart(kill=False)
    assert seen.wait(lambda: len(seen.markers) == 2), "reconnected, ready again"
    assert [(s.filter, s.durable) for s in seen.markers[1].live] == [("nd/#", False)]
    clients(broker.port, "pub", clean_session=True).publish("nd/a", [b"after-reconnect"])
    assert [e.payload for e in recorder.wait(1)] == [b"after-reconnect"]


# ------------------------------------------------------------------------------ sdk.md: publish


def test_a_publish_refused_while_disconnected_is_never_sent_later(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `publish(...)`: Disconnected, it raises `Unconnected` and queues nothing; the
    last-value cache: `publish()` raises `Unconnected` then."""
    receiver = clients(broker.port, "blind2-rx", clean_session=True)
    receiver.subscribe("uc/#", 1)
    seen = Seen()
    client = seen_client(sdk, broker.port, "blind2-unconnected", seen)
    with pytest.raises(Unconnected):
        client.publish("uc/a", b"before-connect")
    client.connect(timeout=WAIT)
    broker.stop()
    assert seen.wait(lambda: len(seen.disconnected) == 1)
    for qos in (0, 1, 2):
        with pytest.raises(Unconnected):
            client.publish("uc/a", f"while-down-{qos}".encode(), qos=qos)
    broker.start()
    assert seen.wait(lambda: len(seen.connected) == 2)
    receiver = clients(broker.port, "blind2-rx2", clean_session=True)
    receiver.subscribe("uc/#", 1)
    client.publish("uc/a", b"sentinel")
    assert receiver.wait_for(lambda ms: any(m.payload == b"sentinel" for m in ms))
    assert [m.payload for m in receiver.messages] == [b"sentinel"]


def test_subscribe_and_publish_raise_request_timeout_when_the_broker_does_not_answer(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: Connected, `subscribe()` returns at the SUBACK (`RequestTimeout` after `timeout`
    without one); `publish(...)`: at QoS 1 and 2 it returns once the broker has the message ...,
    `RequestTimeout` after `timeout` without it (the message stays with paho and is sent again
    after a reconnect, so it may still arrive); waits are bounded (`timeout`)."""
    receiver = clients(broker.port, "blind2-to-rx", clean_session=True)
    receiver.subscribe("to/#", 2)
    client = sdk(broker.port, "blind2-timeouts")
    client.connect(timeout=WAIT)
    with broker.paused():
        began = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.subscribe("to/sub", timeout=0.5)
        with pytest.raises(RequestTimeout):
            client.publish("to/a", b"late-1", qos=1, timeout=0.5)
        with pytest.raises(RequestTimeout):
            client.publish("to/a", b"late-2", qos=2, timeout=0.5)
        assert time.monotonic() - began < WAIT / 2, "each wait ends at its timeout"
    client.publish("to/a", b"after", qos=1)  # still usable
    assert receiver.wait_for(lambda ms: b"after" in [m.payload for m in ms])
    got = [m.payload for m in receiver.messages]
    assert got.count(b"late-1") <= 1 and got.count(b"late-2") <= 1


def test_payload_as_bytearray_memoryview_str_and_empty_arrive_byte_for_byte(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `payload` `bytes` (also `bytearray`, `memoryview`) or a `str`, sent as UTF-8;
    protocol.md: Plain MQTT sessions ... receive the same message unframed; the frame's payload
    is byte for byte as published (an empty one too)."""
    plain = clients(broker.port, "blind2-plain", clean_session=True)
    plain.subscribe("pl/#", 1)
    recorder = Recorder()
    sdk_rx = sdk(broker.port, "blind2-framed")
    sdk_rx.subscribe("pl/#", listener=recorder)
    sdk_rx.connect(timeout=WAIT)
    sdk_rx.ready_for_events()
    sender = sdk(broker.port, "blind2-sender", durable_session=False)
    sender.connect(timeout=WAIT)
    sent: list[Any] = [b"", "", bytearray(b"\x00\xffba"), memoryview(b"mv-bytes")[3:], "é€"]
    for payload in sent:
        sender.publish("pl/x", payload)
    want = [b"", b"", b"\x00\xffba", b"bytes", "é€".encode()]
    assert [e.payload for e in recorder.wait(len(want))] == want
    assert plain.wait_for(lambda ms: len(ms) == len(want)) and [m.payload for m in plain.messages] == want


def test_a_topic_of_65535_utf8_bytes_is_published_and_one_byte_more_is_refused(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `topic` a non-empty string ... valid UTF-8, at most 65535 bytes; the SDK refuses
    [it] before anything is sent."""
    topic = "€" * 21845  # 3 bytes each: 65535 bytes
    assert len(topic.encode()) == 65535
    receiver = clients(broker.port, "blind2-long-rx", clean_session=True)
    receiver.subscribe("#", 1)
    client = sdk(broker.port, "blind2-long", durable_session=False)
    client.connect(timeout=WAIT)
    with pytest.raises(ValueError, match=r"^topic"):
        client.publish(topic + "x", b"too long")
    client.publish(topic, b"longest", qos=2)
    assert receiver.wait_for(lambda ms: len(ms) >= 1)
    assert [(m.topic, m.payload) for m in receiver.messages] == [(topic, b"longest")]
    assert client.connected


# ------------------------------------------------------------------------------ sdk.md: keepalive


def test_a_keepalive_above_the_brokers_max_keepalive_fails_connect_at_once(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md `keepalive` a whole number of seconds from 1 to 65535 (default 30; a broker whose
    `max_keepalive` is set refuses one above it with CONNACK 2, and `connect()` fails at once
    with `ConnectFailed`)."""
    broker = broker_factory(max_keepalive=20)
    began = time.monotonic()
    with pytest.raises(ConnectFailed):
        sdk(broker.port, "blind2-ka-default").connect(timeout=WAIT)  # the default, 30, is above 20
    with pytest.raises(ConnectFailed):
        sdk(broker.port, "blind2-ka-21", keepalive=21).connect(timeout=WAIT)
    assert time.monotonic() - began < WAIT / 2, "at once, not after the connect timeout"
    fits = sdk(broker.port, "blind2-ka-20", keepalive=20)
    fits.connect(timeout=WAIT)
    assert fits.connected


# ------------------------------------------------------------------------------ sdk.md: CPL-2 folders


def test_a_unicode_client_id_with_a_slash_gets_one_percent_encoded_state_folder(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """sdk.md: the marks are kept under `state_dir/<client_id>/` (the id percent-encoded where it
    is not a safe file name: `a/b` is `a%2Fb` ...); delivery-log.md `device` the client id that
    wrote the record."""
    client_id = "Zähler/ß 1"
    state, log = tmp_path / "state", tmp_path / "log.jsonl"
    recorder = Recorder()
    client = sdk(broker.port, client_id, persistence="disk", state_dir=state, delivery_log=log)
    assert client.persistence_level == "disk"
    client.subscribe("uni/#", listener=recorder)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    clients(broker.port, "pub", clean_session=True).publish("uni/a", [b"x"])
    recorder.wait(1)
    client.close()
    (folder,) = list(state.iterdir())
    assert folder.is_dir() and "%2F" in folder.name and "/" not in folder.name
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["device"] for r in records} == {client_id}
    again = sdk(broker.port, client_id, persistence="disk", state_dir=state)
    again.connect(timeout=WAIT)
    assert again.persistence_level == "disk" and list(state.iterdir()) == [folder], "the same folder again"


# ------------------------------------------------------------------ delivery-log.md: resume from the log


@pytest.mark.parametrize("record", ["this epoch", "another epoch", "another device", "last line cut short"])
def test_a_cpl2_client_advances_its_session_mark_only_from_its_own_current_epoch_receives(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path,
    *, caplog: pytest.LogCaptureFixture, record: str,
) -> None:
    """delivery-log.md: a `DurableClient` created with both reads the last 64 KiB of its existing
    log before it connects and takes the last `receive` records of its own client id (`device`; a
    shared file is fine): the highest `seq` of the session's current `epoch` becomes the session
    mark when it is beyond it ... Records of another epoch, raw events, other lines and a last line
    cut short by a crash are ignored; what was advanced is logged at INFO. sdk.md: dedup ...
    drops (but acknowledges) anything at or below it."""
    state, log = tmp_path / "state", tmp_path / "shared.jsonl"
    seen = Seen()
    first = seen_client(sdk, broker.port, "blind2-logmark", seen, persistence="disk", state_dir=state,
                        delivery_log=log)
    first.subscribe("lm/#")
    first.connect(timeout=WAIT)
    first.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    epoch = seen.connected[0].epoch
    first.close(keep_session=True)
    clients(broker.port, "pub", clean_session=True).publish("lm/a", payloads(5))

    forged = {"kind": "receive", "device": "blind2-logmark", "time": time.time(), "topic": "lm/a",
              "id": "00" * 16, "qos": 1, "replayed": True, "redelivered": False, "seq": 10**9,
              "epoch": epoch, "published_at": time.time()}
    if record == "another epoch":
        forged["epoch"] = epoch + 1
    if record == "another device":
        forged["device"] = "someone-else"
    line = json.dumps(forged)
    with log.open("a") as out:
        out.write("not json at all\n")
        out.write(line[:-5] if record == "last line cut short" else line + "\n")

    recorder, again = Recorder(), Seen()
    with caplog.at_level(logging.INFO):
        second = seen_client(sdk, broker.port, "blind2-logmark", again, persistence="disk", state_dir=state,
                             delivery_log=log)
        second.subscribe("lm/#", listener=recorder)
        second.connect(timeout=WAIT)
        second.ready_for_events()
        assert again.wait(lambda: len(again.markers) == 1)
    assert again.markers[0].replayed == 5
    if record == "this epoch":
        assert recorder.payloads() == [], "every queued event is at or below the mark the log gave"
        assert second.stats.duplicates_dropped == 5
        assert any(r.levelno == logging.INFO and str(10**9) in r.getMessage() for r in caplog.records), (
            "what was advanced is logged at INFO"
        )
    else:
        assert recorder.payloads() == payloads(5), f"a record of {record} is ignored"
        assert second.stats.duplicates_dropped == 0


# ------------------------------------------------------------------------------ streams.md: store id


def test_stream_info_store_id_survives_a_restart_and_changes_with_a_new_store(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md `stream_info` ... with `.store` the broker store's random id (ids of two stores
    are not comparable); protocol.md `store`: the store's id (a random number made with the
    store; ... a reader that sees it change knows the store was wiped or replaced); Stream logs
    survive restarts and crashes."""
    streams = [{"filter": "si/#", "max_count": 100, "max_age": 0}]
    broker = broker_factory(streams=streams)
    clients(broker.port, "pub", clean_session=True).publish("si/a", payloads(2))
    seen = Seen()
    reader = seen_client(sdk, broker.port, "blind2-store", seen, durable_session=False)
    reader.connect(timeout=WAIT)
    before = reader.stream_info()
    assert dict(before) == {"si/a": (1, 2)}
    broker.restart(kill=True)
    assert seen.wait(lambda: len(seen.connected) == 2), "reconnected on its own"
    after = reader.stream_info()
    assert dict(after) == {"si/a": (1, 2)} and after.store == before.store
    other = broker_factory(streams=streams)
    clients(other.port, "pub2", clean_session=True).publish("si/a", payloads(2))
    fresh = sdk(other.port, "blind2-store-2", durable_session=False)
    fresh.connect(timeout=WAIT)
    assert fresh.stream_info().store != before.store


# ------------------------------------------------------------------------------ sdk.md: Bad input


@pytest.mark.parametrize("value", ["x" * 65536, "\x01" * 70000])
def test_a_long_value_is_shown_cut_short_with_its_own_length(value: str) -> None:
    """sdk.md, Bad input: a bad value raises `ValueError` whose message starts with the option's
    or argument's name ...; a long value is shown cut short (the length it gives is the value's,
    not that of its quoted and escaped repr)."""
    client = DurableClient("blind2-long-value")
    calls: list[tuple[str, Callable[[str], Any], str]] = [
        ("topic", lambda topic: client.publish(topic, b""), value),
        ("topic_filter", client.subscribe, value + "/#"),
    ]
    for name, call, given in calls:
        with pytest.raises(ValueError, match=f"^{name}") as refused:
            call(given)
        message = str(refused.value)
        assert len(message) < 1000, "cut short"
        assert f"({len(given)} characters)" in message, message


# ------------------------------------------------------------------- streams.md: the longest topics


def test_a_logged_topic_too_long_for_the_stream_prefix_is_listed_but_never_sent(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: Every publish to a logged topic is appended to its log ...; a topic longer
    than 65,516 bytes ... is logged too (`stream_info` lists it), but its events cannot be sent:
    `$durable/v1/stream/<topic>` would pass MQTT's 65,535-byte limit, so a stream subscription
    leaves that topic closed, with a WARNING in the broker's log; protocol.md [the topic] cut to
    100 characters [in the broker's log line]."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 100, "max_age": 0}])
    prefix = "$durable/v1/stream/"
    longest = "telemetry/" + "x" * (65535 - len(prefix) - len("telemetry/"))  # 65,516 bytes: fits
    too_long = longest + "y"
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish(too_long, [b"never sent"])
    publisher.publish(longest, [b"longest"])
    publisher.publish("telemetry/short", [b"short"])
    recorder = Recorder()
    reader = sdk(broker.port, "blind2-long-stream", durable_session=False)
    reader.connect(timeout=WAIT)
    assert dict(reader.stream_info()) == {too_long: (1, 1), longest: (1, 1), "telemetry/short": (1, 1)}
    reader.subscribe_stream("telemetry/#", recorder)
    events = recorder.wait(2)
    assert sorted((len(e.topic), e.payload) for e in events) == [(15, b"short"), (65516, b"longest")]
    assert broker.wait_until(lambda: "topic too long for the $durable/v1/stream/ prefix" in broker.log(), WAIT)
    (line,) = [line for line in broker.log().splitlines() if "topic too long" in line]
    assert len(line) < 500, "the topic is cut short in the log line"
    publisher.publish("telemetry/short", [b"after"])
    assert recorder.wait_until(lambda events: events[-1].payload == b"after")
    assert too_long not in {e.topic for e in recorder.events}
    assert reader.connected


# ------------------------------------------------------------------ sdk.md: a listener that raises


def test_a_listener_raising_on_a_qos0_event_keeps_the_connection_and_loses_nothing_after_it(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: A listener that raises gets the same event again: the client drops the connection
    at once (MQTT redelivers only on reconnect) ... This holds for QoS 1 events: QoS 0 ones are
    gone once sent (so a listener raising on one is logged and the connection kept: dropping it
    would only lose the QoS 0 events sent while the client reconnects)."""
    seen = Seen()
    attempts: list[bytes] = []

    def listener(event: Event) -> None:
        attempts.append(event.payload)
        if event.payload == b"boom":
            raise RuntimeError("listener failed (on purpose)")
        seen.on_event(event)

    client = seen_client(sdk, broker.port, "blind2-qos0-raise", seen)
    client.subscribe("q0/#", qos=0, listener=listener)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    clients(broker.port, "pub", clean_session=True).publish("q0/a", [b"one", b"boom", b"two", b"three"])
    assert seen.wait(lambda: [e.payload for e in seen.events] == [b"one", b"two", b"three"]), attempts
    assert attempts == [b"one", b"boom", b"two", b"three"], "a QoS 0 event does not come again"
    assert seen.disconnected == [] and client.connected, "the connection was kept"
    assert len(seen.connected) == 1


def test_an_async_body_raising_on_a_qos0_event_keeps_the_connection(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """sdk.md asyncio: A body that raises does not acknowledge it: the client reconnects and the
    broker sends it again ..., as for a threaded listener that raises; QoS 0 ones are gone once
    sent (no reconnect for one: it would not come again)."""
    disconnected: list[str] = []

    async def run() -> list[bytes]:
        got: list[bytes] = []
        async with AsyncDurableClient("blind2-async-qos0", HOST, broker.port,
                                      on_disconnected=disconnected.append) as client:
            await client.subscribe("aq0/#", qos=0)
            await client.ready_for_events()
            await asyncio.wait_for(client.live(), WAIT)
            clients(broker.port, "pub", clean_session=True).publish("aq0/a", [b"boom", b"two"])
            with pytest.raises(RuntimeError, match="on purpose"):
                async with client.events() as events:
                    async for event in events:
                        got.append(event.payload)
                        raise RuntimeError("body failed (on purpose)")
            async with client.events() as events:
                async for event in events:
                    got.append(event.payload)
                    break
            assert disconnected == [], "the connection was kept"
        return got

    assert asyncio.run(asyncio.wait_for(run(), WAIT)) == [b"boom", b"two"]


# ------------------------------------------------------------------------- protocol.md: requests

REFUSALS: list[tuple[bytes, str, Any, Any]] = [
    # (request, error code, op echoed, req echoed)
    (b'{"v":1,"op":"hello","req":true}', "malformed", None, None),  # req neither an integer nor absent
    (b'{"v":1,"op":"hello","req":2.0}', "malformed", None, None),
    (b'\xef\xbb\xbf{"v":1,"op":"hello","req":3}', "malformed", None, None),  # not UTF-8 JSON (a BOM)
    (b'{"v":1,"op":"hello","req":4} and more', "malformed", None, None),
    (b'[{"v":1,"op":"hello","req":5}]', "malformed", None, None),  # not an object
    (b'{"v":1,"op":null,"req":6}', "unknown_op", None, 6),  # null counts as absent
    (b'{"v":1,"op":"HELLO","req":7}', "unknown_op", None, 7),
    (b'{"v":null,"op":"hello","req":8}', "unsupported_version", "hello", 8),
    (b'{"v":1,"op":"hello","req":9,"session_expiry":NaN}', "malformed", "hello", 9),  # finite
    (b'{"v":1,"op":"hello","req":10,"session_expiry":Infinity}', "malformed", "hello", 10),
    (b'{"v":1,"op":"hello","req":11,"session_expiry":1e400}', "malformed", "hello", 11),
    (b'{"v":1,"op":"hello","req":12,"session_expiry":true}', "malformed", "hello", 12),
    (b'{"v":1,"op":"hello","req":13,"client_id":""}', "malformed", "hello", 13),  # a string field empty
    (b'{"v":1,"op":"hello","req":14,"client_id":"someone-else"}', "not_your_session", "hello", 14),
    (b'{"v":1,"op":"interest","req":15,"filter":"a/#/b"}', "bad_filter", "interest", 15),
    (b'{"v":1,"op":"interest","req":16,"filter":"x/#","durable":0}', "malformed", "interest", 16),
    (b'{"v":1,"op":"stream_subscribe","req":17,"filter":"telemetry/#","window":true}', "malformed",
     "stream_subscribe", 17),
    (b'{"v":1,"op":"stream_ack","req":18,"topic":"telemetry/a","id":1.5}', "malformed", "stream_ack", 18),
    (b'{"v":1,"op":"stream_ack","req":19,"topic":"telemetry/a","id":1}', "unknown_stream", "stream_ack", 19),
    (b'{"v":1,"op":"stream_info","req":20,"filter":"other/#"}', "unknown_stream", "stream_info", 20),
    (b'{"v":1,"op":"stream_unsubscribe","req":21,"filter":"a/#/b"}', "bad_filter", "stream_unsubscribe", 21),
]


def test_refused_requests_echo_what_could_be_read_and_change_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md Replies: A request too large, not UTF-8 JSON, nested too deeply, not a JSON
    object, or whose `req` is not an integer is answered with `op` and `req` null ...; otherwise
    a refusal echoes `req`, and `op` when it names a known op (null for `unknown_op`); A refused
    request changes nothing: the connection stays up and the session is untouched; `session_expiry`
    (seconds, optional: a finite number >= 0, else `malformed`); a field given as JSON `null`
    counts as absent ... (`v` and `op` as written above)."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}])
    raw = clients(broker.port, "blind2-refusals")
    raw.subscribe("kept/#", 1)
    first = ctl(raw, {"v": 1, "op": "hello", "req": 1, "session_expiry": 60})
    for request, code, op, req in REFUSALS:
        reply = ctl(raw, request)
        assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (False, code, op, req), (
            request, reply,
        )
    after = ctl(raw, {"v": 1, "op": "hello", "req": 2, "session_expiry": 60})
    assert after["ok"] and after["epoch"] == first["epoch"] and after["subscriptions"] == {"kept/#": 1}
    info = ctl(raw, {"v": 1, "op": "stream_info", "req": 3})
    assert info["ok"] and info["filter"] == "#", "stream_info's filter defaults to #"


# ------------------------------------------------------------------------ sdk.md: session_expiry


def test_a_session_expiry_of_0_deletes_the_session_as_soon_as_the_client_leaves(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `session_expiry=seconds` overrides the broker's `session_expiry` for this client;
    `session_expiry` `None` or a finite number of seconds, 0 or more; `on_connected(info)`
    (`session_present`, `epoch`, granted `session_expiry`); guarantees.md `session_expiry: 0`
    deletes a session as soon as it disconnects ... publishes, at QoS 1, on
    `$SYS/broker/durable/expired`; protocol.md `session_expiry` (granted, null for the broker default)."""
    watcher = clients(broker.port, "blind2-expiry-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/expired", 1)
    seen_default, seen_zero = Seen(), Seen()
    default = seen_client(sdk, broker.port, "blind2-default-expiry", seen_default)
    default.connect(timeout=WAIT)
    assert seen_default.connected[0].session_expiry is None, "the broker's default: none granted"
    client = seen_client(sdk, broker.port, "blind2-expiry-0", seen_zero, session_expiry=0)
    client.subscribe("ex/#")
    client.connect(timeout=WAIT)
    info = seen_zero.connected[0]
    assert (info.session_present, info.session_expiry) == (False, 0)
    client.close(keep_session=True)
    assert watcher.wait_for(lambda ms: any(json.loads(m.payload)["client_id"] == "blind2-expiry-0" for m in ms))
    again = clients(broker.port, "blind2-expiry-0")
    assert again.session_present is False, "a client that returns after expiry is a new client"


# ------------------------------------------------------------- sdk.md: calls from a listener, connect


def test_calls_from_a_listener_return_at_once_and_still_take_effect(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md Threads: Called from a listener or callback (the network thread, which cannot wait
    for itself), `subscribe()`, `subscribe_stream()` and `close()` return once their request is
    sent, as `publish()` does: a stream the broker refuses is then the WARNING of a stream opened
    at connect (`the broker refused 'stream_subscribe' ...`; it stays registered), and
    `close(keep_session=False)` still ends the session."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}], metrics_interval=0.1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("telemetry/a", [b"logged"])
    publisher.publish("later/seed", [b"seed"], retain=True)  # comes once the SUBSCRIBE is applied
    outcomes: dict[str, Any] = {}
    done = threading.Event()
    later, streamed = Recorder(), Recorder()

    def listener(event: Event) -> None:
        if event.payload == b"go":
            for name, call in (
                ("subscribe", lambda: client.subscribe("later/#", listener=later)),
                ("stream", lambda: client.subscribe_stream("telemetry/#", streamed)),
                ("refused stream", lambda: client.subscribe_stream("nostream/#", streamed)),
            ):
                began = time.monotonic()
                call()
                outcomes[name] = time.monotonic() - began
            done.set()
        if event.payload == b"bye":
            client.close(keep_session=False)
            done.set()

    with LogWatch() as warnings:
        client = sdk(broker.port, "blind2-from-listener")
        client.subscribe("in/#", listener=listener)
        client.connect(timeout=WAIT)
        client.ready_for_events()
        publisher.publish("in/a", [b"go"])
        assert done.wait(WAIT)
        # Waiting for the reply would take the request timeout (10 s) for the refused stream at least.
        assert all(seconds < 5.0 for seconds in outcomes.values()), outcomes
        assert warnings.wait(lambda m: "the broker refused 'stream_subscribe'" in m and "nostream/#" in m)
    assert [e.payload for e in streamed.wait(1)] == [b"logged"]
    # subscribe() from the listener did not wait for its SUBACK: the retained value sent with the
    # new subscription (sdk.md, initial values) says the broker applied it; a publish before that
    # would not be routed to it.
    (seed,) = later.wait(1)
    assert seed.payload == b"seed" and seed.retained
    publisher.publish("later/a", [b"after"])
    assert [e.payload for e in later.wait(2)] == [b"seed", b"after"]
    done.clear()
    gauges = clients(broker.port, "blind2-gauges", clean_session=True)
    gauges.subscribe("$SYS/broker/durable/sessions/+", 0)
    publisher.publish("in/a", [b"bye"])
    assert done.wait(WAIT)

    def no_session_left(messages: list[Any]) -> bool:
        latest = {m.topic.rsplit("/", 1)[1]: m.payload for m in messages}
        return latest.get("connected") == b"0" and latest.get("disconnected") == b"0"

    assert gauges.wait_for(no_session_left), "the session ended (the metrics count none left)"
    again = clients(broker.port, "blind2-from-listener")
    assert again.session_present is False, "close(keep_session=False) from a listener ended the session"


def test_connect_twice_is_an_error_and_a_closed_client_cannot_connect(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md Threads: `connect()` is called once: a second call raises `DurableClientError` (the
    client reconnects on its own), a call after a `ConnectFailed` tries again, and a closed client
    raises `Unconnected`."""
    client = sdk(broker.port, "blind2-connect-twice")
    client.connect(timeout=WAIT)
    with pytest.raises(DurableClientError):
        client.connect(timeout=WAIT)
    assert client.connected
    client.close()
    with pytest.raises(Unconnected):
        client.connect(timeout=WAIT)
    nowhere = sdk(free_port(), "blind2-connect-retry")
    for _ in range(2):
        with pytest.raises(ConnectFailed):
            nowhere.connect(timeout=0.5)


# ------------------------------------------------------------------ delivery-log.md: ids and kinds


def test_delivery_log_ids_of_unicode_topics_str_and_empty_payloads_match_on_both_sides(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """delivery-log.md `id`: the first 16 bytes of SHA-256 over the topic (UTF-8), a NUL byte and
    the payload, in hex. A publisher and a receiver compute the same id without any framing in
    the payload; `send`, `receive`, `subscribe`, `unsubscribe`, `session_end`, `connect`, `live`;
    `time` Unix seconds; sdk.md a `str` [payload is] sent as UTF-8."""
    sent_log, got_log = tmp_path / "sender.jsonl", tmp_path / "receiver.jsonl"
    seen, recorder = Seen(), Recorder()
    receiver = seen_client(sdk, broker.port, "blind2-log-rx", seen, delivery_log=got_log)
    receiver.subscribe("größe/#", listener=recorder)
    receiver.connect(timeout=WAIT)
    receiver.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    sender = sdk(broker.port, "blind2-log-tx", durable_session=False, delivery_log=sent_log)
    sender.connect(timeout=WAIT)
    bodies: list[bytes | str] = ["grüße", b"", b"\x00\xff"]
    for body in bodies:
        sender.publish("größe/außen", body)
    recorder.wait(len(bodies))
    receiver.unsubscribe("größe/#")
    began = time.time()
    receiver.close(keep_session=False)

    def ident(body: bytes | str) -> str:
        raw = body.encode() if isinstance(body, str) else body
        return hashlib.sha256("größe/außen".encode() + b"\x00" + raw).digest()[:16].hex()

    sends = [json.loads(line) for line in sent_log.read_text().splitlines()]
    records = [json.loads(line) for line in got_log.read_text().splitlines()]
    assert [r["id"] for r in sends if r["kind"] == "send"] == [ident(b) for b in bodies]
    assert [r["id"] for r in records if r["kind"] == "receive"] == [ident(b) for b in bodies]
    # The subscription made before connect() is confirmed (SUBACK) after the CONNACK.
    assert [r["kind"] for r in records] == [
        "connect", "subscribe", "live", "receive", "receive", "receive", "unsubscribe", "session_end",
    ]
    assert all(r["device"] == "blind2-log-rx" and isinstance(r["time"], float) for r in records)
    assert records[-1]["time"] >= began - 1
    assert [r["topic"] for r in records if r["kind"] in {"subscribe", "unsubscribe"}] == ["größe/#", "größe/#"]


# ------------------------------------------------------------------- sdk.md: the largest good inputs


def test_the_largest_client_id_username_and_a_binary_password_connect_and_deliver(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md Bad input: `client_id` a non-empty string without U+0000, at most 65535 bytes in
    UTF-8; `username` `None` or a string without U+0000 and at most 65535 bytes in UTF-8;
    `password` `None`, `bytes` (binary data, U+0000 and any byte allowed) ... at most 65535 bytes;
    `keepalive` a whole number of seconds from 1 to 65535; `host` a host name."""
    client_id = "€" * 21845  # 65,535 bytes
    seen, recorder = Seen(), Recorder()
    username = "ü" * 32767 + "u"  # 65,535 bytes
    client = seen_client(sdk, broker.port, client_id, seen, username=username,
                         password=b"\x00\xff" * 32767 + b"\x00", keepalive=1)
    client.subscribe("big/#", listener=recorder)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    clients(broker.port, "pub", clean_session=True).publish("big/a", [b"one"])
    assert [e.payload for e in recorder.wait(1)] == [b"one"]
    client.close(keep_session=True)
    named = DurableClient("blind2-localhost", "localhost", broker.port)
    try:
        named.connect(timeout=WAIT)
        assert named.connected and named.host == "localhost"
    finally:
        named.close()
    again = clients(broker.port, client_id, username=username)  # the session's owner (guarantees.md)
    assert again.session_present is True, "the session of the 65,535-byte id was kept"


# -------------------------------------------------------------- sdk.md: a session lost while running


def test_a_session_deleted_while_the_client_runs_is_reported_and_started_anew(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: `on_session_lost()` when the broker no longer has a session the client had ...:
    the client then starts as new (GemFire), subscribes again and resets its marks; sdk.md a
    session created anew gets a new [epoch]; protocol.md a session created anew (after expiry,
    `end_session` or a clean connect) gets a new one."""
    seen, recorder = Seen(), Recorder()
    lost = threading.Event()
    client = seen_client(sdk, broker.port, "blind2-lost", seen, on_session_lost=lost.set)
    client.subscribe("sl/#", listener=recorder)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("sl/a", payloads(3, "old"))
    recorder.wait(3)
    # A clean CONNECT of the client id deletes the session (and takes the connection over).
    intruder = clients(broker.port, "blind2-lost", clean_session=True)
    assert intruder.session_present is False
    assert lost.wait(WAIT), "on_session_lost was called"
    assert seen.wait(lambda: len(seen.markers) == 2)
    first, second = seen.connected[0], seen.connected[-1]
    assert second.session_present is False and second.epoch != first.epoch
    assert [(s.filter, s.durable) for s in seen.markers[-1].live] == [("sl/#", True)], "subscribed again"
    publisher.publish("sl/a", payloads(3, "new"))
    events = recorder.wait(6)
    assert [e.payload for e in events] == payloads(3, "old") + payloads(3, "new")
    assert {e.epoch for e in events[3:]} == {second.epoch}, "the new session's ids are not dropped by old marks"


# ------------------------------------------------------------- sdk.md: a publish the broker would refuse


@pytest.mark.parametrize("qos", [0, 1])
def test_a_publish_larger_than_the_brokers_max_packet_size_is_refused_before_it_is_sent(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    qos: int,
) -> None:
    """sdk.md `publish`: `payload` ... at most what the broker's `max_packet_size` lets a PUBLISH
    carry (its hello reply says it): a larger one raises `ValueError` naming `payload` before
    anything is sent (the broker would close the connection, and paho would send the message
    again after every reconnect); guarantees.md a packet whose remaining length is larger than
    `max_packet_size` ... closes the connection; protocol.md hello reply `max_packet_size`."""
    broker = broker_factory(max_packet_size=4096)
    receiver = clients(broker.port, "blind2-big-rx", clean_session=True)
    receiver.subscribe("big/#", 1)
    seen = Seen()
    client = seen_client(sdk, broker.port, "blind2-big", seen)
    client.connect(timeout=WAIT)
    topic = "big/a"
    fits = 4096 - 2 - len(topic) - (2 if qos else 0)  # remaining length: topic, packet id, payload
    with pytest.raises(ValueError, match=r"^payload") as refused:
        client.publish(topic, b"x" * (fits + 1), qos=qos)
    assert "max_packet_size" in str(refused.value) and "4096" in str(refused.value)
    client.publish(topic, b"y" * fits, qos=qos)
    client.publish(topic, b"after", qos=1)
    assert receiver.wait_for(lambda ms: [m.payload for m in ms][-1:] == [b"after"])
    assert [len(m.payload) for m in receiver.messages] == [fits, 5]
    assert seen.disconnected == [] and client.connected, "the connection was never closed"
    assert "larger than max_packet_size" not in broker.log()


# ---------------------------------------------------- streams.md: resuming a stream of many topics


def read_many_topics_then_restart(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], count: int
) -> tuple[list[str], Seen, Recorder]:
    """A stateless reader of ``telemetry/#`` reads one event on each of ``count`` topics; the broker
    restarts, and the reader, reconnected, presents only the positions that fit (its WARNING)."""
    topics = [f"telemetry/device-{i:06d}" for i in range(count)]
    publisher = clients(broker.port, "pub", clean_session=True)
    for start in range(0, len(topics), 500):
        infos = [publisher.paho.publish(topic, b"first", qos=1) for topic in topics[start:start + 500]]
        for info in infos:
            info.wait_for_publish(WAIT)
            assert info.is_published()
    seen, recorder = Seen(), Recorder()
    reader = seen_client(sdk, broker.port, f"blind2-many-{count}", seen, durable_session=False)
    reader.connect(timeout=WAIT)
    reader.subscribe_stream("telemetry/#", recorder, window=100)
    recorder.wait(len(topics), timeout=60)
    with LogWatch() as warnings:
        broker.restart(kill=False)
        assert seen.wait(lambda: len(seen.connected) == 2)
        fit = rf"telemetry/#: \d+ of {count} positions fit the \d+-byte"
        assert warnings.wait(lambda m: re.search(fit, m) is not None)
    return topics, seen, recorder


@pytest.mark.slow
def test_a_stream_reader_of_thousands_of_topics_resumes_after_a_reconnect(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: the client presents the last id it processed per topic (from its CPL-1/CPL-2
    marks) or none, and the broker sends the next events; protocol.md a request ... at most
    65,536 bytes; the filters open and the positions kept on one connection are bounded by the
    broker's `max_stream_entries_per_client` (default 10000). 3,000 positions do not fit one
    request: the reader still resumes, and processes each event once."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 100, "max_age": 0}])
    topics, _seen, recorder = read_many_topics_then_restart(broker, sdk, clients, 3000)
    publisher = clients(broker.port, "pub-2", clean_session=True)
    publisher.publish(topics[0], [b"second"])
    publisher.publish(topics[-1], [b"second"])
    events = recorder.wait(len(topics) + 2, timeout=60)
    assert sorted(e.topic for e in events if e.payload == b"second") == [topics[0], topics[-1]]
    assert len(events) == len(topics) + 2, "each event processed once"


def test_an_sdk_session_subscribed_to_the_expiry_topic_gets_each_expiry_as_an_event(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """guarantees.md: Wills and broker-internal messages (`$SYS/...`) reach durable sessions
    through the same queue; on expiry the broker publishes, at QoS 1, on
    `$SYS/broker/durable/expired`: `{"client_id": "...", "messages_dropped": 12, "disconnected_at":
    ...}`; sdk.md `publish` ... not starting with `$` (subscribing to one is allowed: only the
    SDK's own topics are refused)."""
    seen, recorder = Seen(), Recorder()
    watcher = seen_client(sdk, broker.port, "blind2-sys-watch", seen)
    watcher.subscribe("$SYS/broker/durable/expired", listener=recorder)
    watcher.connect(timeout=WAIT)
    watcher.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    leaving = sdk(broker.port, "blind2-sys-leaving", session_expiry=0)
    leaving.subscribe("sys/#")
    leaving.connect(timeout=WAIT)
    began = time.time()
    leaving.close(keep_session=True)
    (event,) = recorder.wait(1)
    body = json.loads(event.payload)
    assert (event.topic, body["client_id"], body["messages_dropped"]) == (
        "$SYS/broker/durable/expired", "blind2-sys-leaving", 0,
    )
    assert began - 1 <= body["disconnected_at"] <= time.time() + 1
    assert event.seq > 0 and event.epoch == seen.connected[0].epoch and not event.replayed


def test_the_async_clients_methods_take_the_documented_arguments(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """sdk.md asyncio: `subscribe(topic_filter, qos=1, *, durable=True)`, `subscribe_stream(
    topic_filter, *, window=None, after=None)`, `unsubscribe(topic_filter)`, `publish(topic,
    payload, qos=1, retain=False)`, `stream_info(topic_filter="#")`, `connect()`,
    `close(keep_session=True)`; none takes a `timeout`, and none takes a listener (every event
    comes through `events()`)."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}])
    clients(broker.port, "pub", clean_session=True).publish("telemetry/a", payloads(3))

    async def run() -> tuple[list[tuple[str, bytes]], Any]:
        client = AsyncDurableClient("blind2-async-args", HOST, broker.port)
        await client.connect()
        try:
            with pytest.raises(TypeError):
                await client.subscribe("aa/#", 1, listener=print)  # type: ignore[call-arg]
            with pytest.raises(TypeError):
                await client.publish("aa/x", b"x", 1, False, timeout=1.0)  # type: ignore[call-arg]
            await client.subscribe("aa/#", 1, durable=False)
            await client.subscribe_stream("telemetry/#", window=2, after={"telemetry/a": 1})
            bounds = await client.stream_info()
            await client.ready_for_events()
            await client.publish("aa/x", "text", 1, False)
            got: list[tuple[str, bytes]] = []
            async with client.events() as events:
                async for event in events:
                    got.append((event.topic, event.payload))
                    if len(got) == 3:
                        break
            await client.unsubscribe("aa/#")
        finally:
            await client.close(keep_session=True)
        return got, bounds

    got, bounds = asyncio.run(asyncio.wait_for(run(), 2 * WAIT))
    assert sorted(got) == [("aa/x", b"text"), ("telemetry/a", b"m0000001"), ("telemetry/a", b"m0000002")]
    assert dict(bounds) == {"telemetry/a": (1, 3)}


# ---------------------------------------------------------------- delivery-log.md: a full disk


def test_a_delivery_log_on_a_full_disk_ends_the_log_not_the_client(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """delivery-log.md: Writes are appended and flushed per record ...; a write that fails (a
    full disk, an I/O error) is logged as an ERROR and ends the log: the client goes on without
    it; a log that cannot be opened for appending (a folder, a path under a file) raises that
    `OSError` when the `DurableClient` is created. sdk.md Acknowledge after processing (each
    event processed once)."""
    from small_disk import fill, small_disk  # noqa: PLC0415 - mounts a real tmpfs (root only)

    (tmp_path / "a-file").write_text("not a folder")
    for unusable in (tmp_path, tmp_path / "a-file" / "device.jsonl"):
        with pytest.raises(OSError):
            DurableClient("blind2-bad-log", HOST, broker.port, delivery_log=unusable)

    with small_disk(tmp_path / "disk", 2) as disk, LogWatch() as problems:
        seen, recorder = Seen(), Recorder()
        client = seen_client(sdk, broker.port, "blind2-full-log", seen, delivery_log=disk / "device.jsonl")
        client.subscribe("fl/#", listener=recorder)
        client.connect(timeout=WAIT)
        client.ready_for_events()
        assert seen.wait(lambda: len(seen.markers) == 1)
        fill(disk)
        clients(broker.port, "pub", clean_session=True).publish("fl/a", payloads(200))
        assert [e.payload for e in recorder.wait(200)] == payloads(200), "each event processed once, in order"
        client.publish("fl/b", b"still publishing")
        assert client.connected and seen.disconnected == [] and len(seen.connected) == 1
        errors = [m for m in problems.messages if "cannot write the delivery log" in m]
        assert len(errors) == 1 and "No space left" in errors[0], problems.messages
        client.close()


def test_a_delivery_log_reopened_after_a_cut_last_line_starts_its_first_record_on_a_new_line(
    tmp_path: Path,
) -> None:
    """delivery-log.md: a write that fails ... ends the log (its last line may be cut short);
    a client created later on a log whose last line is cut short ends that line first, so its
    own first record starts a line of its own (one JSON object per line)."""
    from durable_client.delivery_log import DeliveryLog  # noqa: PLC0415 - the documented module

    path = tmp_path / "device.jsonl"
    cut = '{"kind": "receive", "device": "d", "top'  # what a full disk left
    path.write_text(cut)
    log = DeliveryLog(path, "d")
    log.connect(True)
    log.close()
    lines = path.read_text().splitlines()
    assert lines[0] == cut and len(lines) == 2, lines
    assert json.loads(lines[1])["kind"] == "connect"
    log = DeliveryLog(path, "d")  # a log that ends a line gets no empty line
    log.connect(False)
    log.close()
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()[1:]] == ["connect", "connect"]


def test_a_stream_reader_presents_only_the_positions_that_fit_the_brokers_max_packet_size(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: the positions presented are cut to those that fit one request (the broker's
    max_packet_size, when its hello reply says it, or 64 KiB) with a WARNING; the others
    are sent from their first retained event and the marks drop what was processed. 300
    positions (~9 KB) under max_packet_size 4096: the reader still resumes after a restart."""
    broker = broker_factory(max_packet_size=4096, streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}])
    topics, seen, recorder = read_many_topics_then_restart(broker, sdk, clients, 300)
    clients(broker.port, "pub-2", clean_session=True).publish(topics[0], [b"second"])
    events = recorder.wait(len(topics) + 1, timeout=30)
    assert [e.topic for e in events if e.payload == b"second"] == [topics[0]]
    assert len(events) == len(topics) + 1, "each event processed once"
    assert len(seen.connected) == 2, "no connection closed for its size"
    assert "larger than max_packet_size" not in broker.log()


def test_positions_past_a_logs_end_on_long_topics_are_logged_cut_short_on_both_sides(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: positions past a log's end are reported (a wiped store?); a logged topic is cut
    to 100 characters in a log line (streams.md, the WARNING of a topic too long for the stream
    prefix), on the client's side and the broker's: neither writes a 2,000-character topic."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}])
    topics = [f"telemetry/{i}/" + "x" * 2000 for i in range(8)]
    publisher = clients(broker.port, "pub", clean_session=True)
    for topic in topics:
        publisher.publish(topic, [b"logged"])
    with LogWatch() as warnings:
        client = sdk(broker.port, "blind2-ahead-long", durable_session=False)
        client.connect(timeout=WAIT)
        client.subscribe_stream("telemetry/#", Recorder(), after=dict.fromkeys(topics, 10**9))
        assert warnings.wait(lambda m: "past the log's last id" in m)
        ahead = [m for m in warnings.messages if "past the log's last id" in m]
    assert len(ahead) == len(topics), ahead
    assert all(len(m) < 600 and f"stream {t[:100]}...:" in m for m, t in zip(ahead, topics, strict=True)), ahead
    lines = [line for line in broker.log().splitlines() if "positions past the log end" in line]
    assert len(lines) == 1 and "8 positions" in lines[0] and len(lines[0]) < 1500, lines


def test_an_unacknowledged_publish_larger_than_a_restarted_brokers_limit_is_dropped_not_resent_for_ever(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md `publish`: a QoS 1/2 publish paho keeps unacknowledged across a reconnect goes out
    again once the hello reply says the broker's max_packet_size; one larger than that (a broker
    restarted, or failed over, with a smaller one) is dropped with an ERROR naming its topic and
    size, and a publish() still waiting for it raises ValueError; one that fits is delivered.
    Before: paho re-sent it right after CONNACK and the broker closed every connection, for ever."""
    broker = broker_factory()
    seen, later, received = Seen(), Recorder(), Recorder()
    client = seen_client(sdk, broker.port, "blind2-inflight", seen)
    client.subscribe("ok/#", listener=later)
    client.subscribe("big/#", listener=received)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    outcomes: dict[str, Any] = {}

    def send(name: str, payload: bytes) -> None:
        try:
            client.publish(f"big/{name}", payload, qos=1, timeout=WAIT)
            outcomes[name] = "acknowledged"
        except Exception as exc:
            outcomes[name] = exc

    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)  # it acknowledges nothing: both stay unacknowledged in paho
    senders = [threading.Thread(target=send, args=args, daemon=True)
               for args in (("large", b"x" * 8000), ("small", b"fits"))]
    for sender in senders:
        sender.start()
    paho = client._link._client  # type: ignore[union-attr]  # white-box: when both are handed over
    assert wait_until(lambda: len(paho._out_messages) == 2, WAIT)
    broker.kill()  # stopped: what it had not read is lost with it
    broker.settings["max_packet_size"] = 4096
    with LogWatch() as problems:
        broker.start()
        for sender in senders:
            sender.join(WAIT + 5)
        assert problems.wait(lambda m: "dropping the unacknowledged publish to big/large" in m and "4096" in m)
    assert outcomes["small"] == "acknowledged", outcomes
    assert isinstance(outcomes["large"], ValueError), outcomes
    assert str(outcomes["large"]).startswith("payload") and "4096" in str(outcomes["large"])
    assert "may have been delivered" in str(outcomes["large"]), "the broker may have had it (its PUBACK lost)"
    assert any("big/large" in m and "may have been delivered" in m for m in problems.messages)
    assert [e.payload for e in received.wait(1)] == [b"fits"]
    client.publish("ok/a", b"after")
    assert [e.payload for e in later.wait(1)] == [b"after"]
    assert len(seen.connected) == 2, "one reconnect, not a loop"
    assert "larger than max_packet_size" not in broker.log()


def _stop_broker_at_first_pubrel(
    client: DurableClient, broker: Broker
) -> tuple[threading.Event, list[int], list[int]]:
    """White-box: SIGSTOP the broker as paho sends its first PUBREL (the broker has the QoS 2
    publish, its PUBREC came, and never reads that PUBREL); returns (stopped, every PUBREL's mid,
    every PUBLISH's mid)."""
    paho = client._link._client  # type: ignore[union-attr]
    original = paho._send_pubrel
    original_publish = paho._send_publish
    stopped = threading.Event()
    pubrels: list[int] = []
    publishes: list[int] = []

    def publish_hooked(mid: int, *args: Any, **kwargs: Any) -> Any:
        publishes.append(mid)
        return original_publish(mid, *args, **kwargs)

    def hooked(mid: int) -> Any:
        pubrels.append(mid)
        if not stopped.is_set():
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGSTOP)
            stopped.set()
        return original(mid)

    paho._send_pubrel = hooked
    paho._send_publish = publish_hooked
    return stopped, pubrels, publishes


def _qos2_publish_awaiting_pubcomp(
    client: DurableClient, broker: Broker, subscriber: Client, payload: bytes
) -> tuple[Client, list[int], list[int], threading.Thread, dict[str, Any]]:
    """Connect ``client``, subscribe ``subscriber`` to q2/# at QoS 2, publish ``payload`` at QoS 2
    to q2/x and kill the broker as the PUBREL goes: the publish waits for its PUBCOMP. Returns
    (subscriber, PUBREL mids, PUBLISH mids, the sender, its outcome)."""
    client.connect(timeout=WAIT)
    subscriber.subscribe("q2/#", qos=2)
    stopped, pubrels, publishes = _stop_broker_at_first_pubrel(client, broker)
    outcome: dict[str, Any] = {}
    sender = _publish_in_thread(client, "q2/x", payload, outcome)
    assert stopped.wait(WAIT)
    broker.kill()
    return subscriber, pubrels, publishes, sender, outcome


def _publish_in_thread(client: DurableClient, topic: str, payload: bytes, outcome: dict[str, Any]) -> threading.Thread:
    def send() -> None:
        try:
            client.publish(topic, payload, qos=2, timeout=WAIT)
            outcome["r"] = "acknowledged"
        except Exception as exc:
            outcome["r"] = exc

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_a_qos2_publish_the_broker_has_is_released_not_dropped_by_a_restarted_brokers_smaller_limit(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `publish`: a QoS 2 publish whose PUBREC came (the broker has it) goes on with its
    PUBREL after a reconnect, never dropped for its size. Before: paho's reset at every
    reconnect() turned it back into a PUBLISH, the SDK dropped it for a restarted broker's
    smaller max_packet_size and publish() raised ValueError, though the subscriber got it."""
    broker = broker_factory()
    client = sdk(broker.port, "blind2-pubrel-size")
    subscriber, pubrels, publishes, sender, outcome = _qos2_publish_awaiting_pubcomp(
        client, broker, clients(broker.port, "blind2-pubrel-sub", clean_session=False), b"y" * 3000
    )
    broker.settings["max_packet_size"] = 1024
    with LogWatch() as problems:
        broker.start()
        sender.join(WAIT + 5)
    assert outcome.get("r") == "acknowledged", outcome
    assert pubrels == [pubrels[0]] * 2, pubrels
    assert publishes.count(pubrels[0]) == 1, ("released, not published again", publishes)
    assert not [m for m in problems.messages if "dropping" in m], problems.messages
    subscriber.connect()
    assert [m.payload for m in subscriber.wait_messages(1)] == [b"y" * 3000]


def test_a_qos2_publish_waiting_for_pubcomp_across_refused_reconnects_is_released_once(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """A QoS 2 publish waiting for its PUBCOMP while the broker is down (reconnect attempts
    refused) is released with one PUBREL after the restart and delivered once. Before: paho's
    second reset made it a PUBLISH again."""
    broker = broker_factory()
    client = sdk(broker.port, "blind2-pubrel-refused")
    subscriber, pubrels, publishes, sender, outcome = _qos2_publish_awaiting_pubcomp(
        client, broker, clients(broker.port, "blind2-pubrel-sub2", clean_session=False), b"only-once"
    )
    link = client._link
    assert link is not None
    opens: list[int] = []
    original_open = link.open

    def counting_open() -> None:
        opens.append(1)
        original_open()

    link.open = counting_open  # type: ignore[method-assign]
    assert wait_until(lambda: len(opens) >= 3, WAIT), "reconnect attempts refused while the broker is down"
    broker.start()
    sender.join(WAIT + 5)
    assert outcome.get("r") == "acknowledged", outcome
    assert pubrels == [pubrels[0]] * 2, pubrels
    assert publishes.count(pubrels[0]) == 1, ("released, not published again", publishes)
    subscriber.connect()
    assert [m.payload for m in subscriber.wait_messages(1)] == [b"only-once"]
    assert not subscriber.wait_for(lambda ms: len(ms) > 1, 1.0), "delivered twice"


def test_a_publish_landing_before_the_hello_reply_goes_after_the_held_ones(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `publish`: unacknowledged publishes go out again, in order, at the hello reply; a
    publish handed to paho after CONNACK but before that reply (an application thread that saw
    the client connected) goes after them. Before: paho sent it at once, ahead of them."""
    broker = broker_factory()
    client = sdk(broker.port, "blind2-late-publish")
    client.connect(timeout=WAIT)
    subscriber = clients(broker.port, "blind2-late-sub", clean_session=False)
    subscriber.subscribe("rc/#", qos=1)
    original = client._finish_handshake
    landed = threading.Event()

    def hooked(reply: Any) -> None:  # white-box: the publish lands just before the reply is handled
        if not landed.is_set():
            landed.set()
            link = client._link
            assert link is not None
            link.publish("rc/x", b"late", 1)
        original(reply)

    client._finish_handshake = hooked  # type: ignore[method-assign]
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)  # it acknowledges nothing: they stay unacknowledged in paho
    outcomes: dict[bytes, Any] = {}

    def send(payload: bytes) -> None:
        try:
            client.publish("rc/x", payload, qos=1, timeout=WAIT)
            outcomes[payload] = "acknowledged"
        except Exception as exc:
            outcomes[payload] = exc

    paho = client._link._client  # type: ignore[union-attr]
    senders = []
    for i in range(3):
        senders.append(threading.Thread(target=send, args=(f"e{i}".encode(),), daemon=True))
        senders[-1].start()
        assert wait_until(lambda n=i + 1: len(paho._out_messages) == n, WAIT), "handed over in this order"
    broker.kill()
    broker.start()
    for sender in senders:
        sender.join(WAIT + 5)
    assert landed.is_set() and set(outcomes.values()) == {"acknowledged"}, outcomes
    subscriber.connect()
    assert [m.payload for m in subscriber.wait_messages(4)] == [b"e0", b"e1", b"e2", b"late"]


def test_filters_whose_packets_exceed_max_packet_size_are_refused_or_dropped_never_resent(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md Bad input: a filter whose SUBSCRIBE, UNSUBSCRIBE or control request would be larger
    than the broker's max_packet_size (once a hello reply said it) is a ValueError naming
    `topic_filter` in subscribe, unsubscribe, subscribe_stream and stream_info; one registered
    before the broker said it is dropped at the hello reply with an ERROR, not sent. Before: the
    broker closed the connection for it and the SDK sent it again after every reconnect."""
    broker = broker_factory(max_packet_size=1024, streams=[{"filter": "long/#", "max_count": 10, "max_age": 0}])
    seen, recorder = Seen(), Recorder()
    early = "long/" + "e" * 2000
    client = seen_client(sdk, broker.port, "blind2-long-filter", seen)
    client.subscribe("ok/#", listener=recorder)
    client.subscribe(early, listener=recorder)
    client.subscribe_stream(early + "/#", recorder)
    with LogWatch() as problems:
        client.connect(timeout=WAIT)
        client.ready_for_events()
        assert seen.wait(lambda: len(seen.markers) == 1), "no marker: the connection was closed"
        dropped = [m for m in problems.messages if m.startswith("dropping the") and "max_packet_size (1024" in m]
    assert len(dropped) == 2 and all(len(m) < 400 for m in dropped), problems.messages
    late = "long/" + "x" * 2000
    calls: list[Callable[[], object]] = [
        lambda: client.subscribe(late, listener=recorder),
        lambda: client.unsubscribe(late),
        lambda: client.subscribe_stream(late, recorder),
        lambda: client.stream_info(late),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^topic_filter: .*max_packet_size \(1024 bytes\)"):
            call()
    client.subscribe("ok2/" + "y" * 900, listener=recorder)  # fits: its SUBSCRIBE is 909 bytes
    clients(broker.port, "pub", clean_session=True).publish("ok/a", [b"after"])
    assert [e.payload for e in recorder.wait(1)] == [b"after"]
    assert len(seen.connected) == 1 and seen.disconnected == [], "the connection was never closed"
    assert "larger than max_packet_size" not in broker.log()


def test_subscribe_returns_at_the_suback_of_the_subscribe_sent_again_after_a_reconnect_or_times_out(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: connected, `subscribe()` returns at the SUBACK (`RequestTimeout` after `timeout`
    without one); the subscription stays registered and is sent again on reconnect. A connection
    lost before the SUBACK is no SUBACK: subscribe() waits for the one of the SUBSCRIBE sent
    again after the reconnect, within its timeout. Before: it returned at the drop."""
    broker = broker_factory()
    seen, recorder = Seen(), Recorder()
    client = seen_client(sdk, broker.port, "blind2-sub-drop", seen)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    outcomes: dict[str, Any] = {}

    def subscribe(topic_filter: str, timeout: float) -> None:
        try:
            client.subscribe(topic_filter, listener=recorder, timeout=timeout)
            outcomes[topic_filter] = len(seen.connected)  # the connections made when it returned
        except Exception as exc:
            outcomes[topic_filter] = exc

    for topic_filter, timeout in (("a/#", 3.0), ("b/#", WAIT)):
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGSTOP)  # no SUBACK
        caller = threading.Thread(target=subscribe, args=(topic_filter, timeout), daemon=True)
        caller.start()
        assert wait_until(lambda f=topic_filter: client._registry.get(f) is not None, WAIT)  # white-box: registered
        broker.kill()
        if topic_filter == "a/#":
            caller.join(timeout + 5)
            assert isinstance(outcomes["a/#"], RequestTimeout), outcomes
        connections = len(seen.connected)
        broker.start()
        assert seen.wait(lambda n=connections: len(seen.connected) == n + 1)
        caller.join(timeout + 5)
    assert outcomes["b/#"] == 3, f"returned once reconnected (3 connections), not at the drop: {outcomes}"
    clients(broker.port, "pub", clean_session=True).publish("a/x", [b"a"])
    clients(broker.port, "pub2", clean_session=True).publish("b/x", [b"b"])
    assert sorted(e.payload for e in recorder.wait(2)) == [b"a", b"b"], "both sent again on reconnect"


def test_a_subscribe_waiting_for_its_suback_returns_when_the_client_is_closed(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: `subscribe()` returns at the SUBACK (`RequestTimeout` after `timeout` without one);
    `close()` from another thread ends the wait at once, with `Unconnected`, rather than after
    the whole timeout (or returning as if confirmed)."""
    client = sdk(broker.port, "blind2-sub-close")
    client.connect(timeout=WAIT)
    outcome = _interrupted_subscribe(client, broker, "c/#", lambda: client.close(timeout=2))
    assert isinstance(outcome, Unconnected), outcome


def _interrupted_subscribe(
    client: DurableClient, broker: Broker, topic_filter: str, interrupt: Callable[[], object]
) -> object:
    """subscribe() in a thread while the broker is paused (no SUBACK), ``interrupt()`` once it is
    registered: what subscribe() did ("returned" or its exception), which must come at once."""
    returned = threading.Event()
    outcome: list[object] = []

    def subscribe() -> None:
        try:
            client.subscribe(topic_filter, timeout=60)
            outcome.append("returned")
        except DurableClientError as exc:
            outcome.append(exc)
        returned.set()

    with broker.paused():
        threading.Thread(target=subscribe, daemon=True).start()
        assert wait_until(lambda: client._registry.get(topic_filter) is not None, WAIT)  # white-box: registered
        interrupt()
        assert returned.wait(WAIT), "subscribe() still waits"
    return outcome[0]


def test_a_subscribe_waiting_across_a_reconnect_that_drops_it_for_its_size_raises_value_error(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: a `subscribe()` waiting for its SUBACK across a reconnect whose hello reply drops
    the subscription (a broker restarted with a smaller max_packet_size) raises
    `ValueError("topic_filter: ...")`. Before: it returned as if confirmed."""
    broker = broker_factory()
    client = sdk(broker.port, "blind2-sub-size-drop")
    client.connect(timeout=WAIT)
    long_filter = "long/" + "z" * 2000
    outcome: list[object] = []

    def subscribe() -> None:
        try:
            client.subscribe(long_filter, timeout=WAIT)
            outcome.append("returned")
        except Exception as exc:
            outcome.append(exc)

    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)  # no SUBACK
    waiter = threading.Thread(target=subscribe, daemon=True)
    waiter.start()
    assert wait_until(lambda: client._registry.get(long_filter) is not None, WAIT)  # white-box: registered
    broker.kill()
    broker.settings["max_packet_size"] = 1024
    with LogWatch() as problems:
        broker.start()
        waiter.join(WAIT + 5)
        assert problems.wait(lambda m: "dropping the subscription" in m)
    assert isinstance(outcome[0], ValueError) and str(outcome[0]).startswith("topic_filter"), outcome


def test_an_unsubscribe_due_at_a_reconnect_whose_hello_reply_says_a_smaller_limit_is_dropped_not_sent(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md Bad input: a filter registered before the broker said its max_packet_size is
    dropped at the hello reply with an ERROR, not sent; so is a durable session's UNSUBSCRIBE due
    on the next connection (made while disconnected) whose packet a restarted broker's smaller
    max_packet_size refuses: the connection stays up and the marker comes."""
    broker = broker_factory()
    seen = Seen()
    client = seen_client(sdk, broker.port, "blind2-unsub-size-drop", seen)
    long_filter = "long/" + "u" * 2000
    client.connect(timeout=WAIT)
    client.subscribe(long_filter, timeout=WAIT)
    broker.kill()
    assert seen.wait(lambda: len(seen.disconnected) == 1)
    client.unsubscribe(long_filter)  # disconnected: due on the next connection
    broker.settings["max_packet_size"] = 1024
    with LogWatch() as problems:
        broker.start()
        assert seen.wait(lambda: len(seen.connected) == 2)
        client.ready_for_events()
        assert seen.wait(lambda: len(seen.markers) == 1), "no marker: the connection was closed"
        dropped = [m for m in problems.messages if m.startswith("dropping the unsubscribe of long/")]
    assert len(dropped) == 1 and "max_packet_size (1024 bytes)" in dropped[0], problems.messages
    assert len(seen.disconnected) == 1 and client.connected, "the connection was never closed"
    assert "larger than max_packet_size" not in broker.log()


def test_a_subscribe_whose_filter_another_thread_unsubscribes_returns_at_once(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: a `subscribe()` waiting for its SUBACK returns at once when another thread
    unsubscribes the filter, before its wait starts or during it. Before: one whose filter was
    gone when the wait started waited out its whole timeout and raised RequestTimeout."""
    client = sdk(broker.port, "blind2-sub-unsub")
    client.connect(timeout=WAIT)
    start = time.monotonic()
    assert client._registry.wait_answered("never/#", 30.0, client._stop.is_set)  # white-box: gone at the start
    assert time.monotonic() - start < 5.0
    assert _interrupted_subscribe(client, broker, "u/#", lambda: client.unsubscribe("u/#")) == "returned"


@pytest.mark.parametrize(("numerator", "denominator"), [(10**4301, 3), (1, 10**4301)], ids=["numerator", "denominator"])
def test_a_fraction_of_long_integers_is_shown_as_its_size_in_bits(numerator: int, denominator: int) -> None:
    """sdk.md, Bad input: the message starts with the option's name; a fraction whose numerator or
    denominator is past the digit limit is shown as their sizes in bits (its repr raised Python's own
    ValueError)."""
    value = Fraction(numerator, denominator)
    with pytest.raises(ValueError, match=r"^reconnect_min_delay ") as refused:
        DurableClient("blind2-long-fraction", reconnect_min_delay=value)
    shown = f"a fraction of {value.numerator.bit_length()}/{value.denominator.bit_length()} bits"
    assert str(refused.value).endswith(f"got {shown}"), str(refused.value)[:300]
