"""Black-box tests written from README.md, docs/guarantees.md, store-layout.md, architecture.md and
configuration.md alone, at the edges earlier rounds left open: the in-flight window's refill at and
below 32, every drop logged with `drop_log_interval: 0`, a unicode client id in the overflow and
expiry lines, and which writes wait for company with `sync: true`. Each quotes its promise."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly
from test_blind_core import read_all, write_config
from test_blind_docs4 import hello
from test_blind_ops3 import wait_for_log
from test_blind_protocol3 import Raw
from test_hostile_store import folder_digest

from conftest import HOST, WAIT, Broker, Client, mqtt_packet, payloads, run_cli

pytestmark = pytest.mark.timeout(120)

UNICODE_ID = "dévice-ü/温度"
"""A client id with accents, a slash and CJK characters (all of them valid in MQTT's UTF-8 strings)."""


def queued_for_away_device(
    clients: Callable[..., Client], broker: Broker, client_id: str, count: int, topic: str = "w/t"
) -> None:
    """Durable ``client_id`` subscribes to ``topic`` at QoS 1 and leaves; a clean publisher then
    publishes ``count`` QoS 1 messages to it (all acknowledged, so all queued or dropped)."""
    device = clients(broker.port, client_id)
    device.subscribe(topic, 1)
    device.disconnect()
    clients(broker.port, f"pub-{client_id}", clean_session=True).publish(topic, payloads(count), qos=1)


# ------------------------------------------------------------------ guarantees.md / configuration.md: the window


@pytest.mark.parametrize(("window", "quarter"), [(32, 8), (1, 1), (31, 1)])
def test_the_window_refills_a_quarter_at_a_time_from_32_and_at_each_ack_below(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], window: int, quarter: int
) -> None:
    """configuration.md `recovery_buffer` (1 to 65535): "also the in-flight window (a full window of 32
    or more is refilled a quarter at a time: with 100, the next 25 go once 25 are acknowledged)";
    guarantees.md: "at most that many QoS 1/2 messages are sent and not yet acknowledged". At 32 a
    quarter is 8: seven acks bring nothing, the eighth the next 8. Below 32 (1 and 31) the quarter rule
    does not hold: each ack lets the next message go."""
    broker = broker_factory(recovery_buffer=window)
    queued_for_away_device(clients, broker, "win-dev", window + 20)
    device = clients(broker.port, "win-dev", manual_ack=True)
    assert len(device.wait_messages(window)) >= window
    assert not device.wait_for(lambda ms: len(ms) > window, timeout=1.0), f"more than {window} in flight"
    for message in device.messages[: quarter - 1]:
        device.paho.ack(message.mid, message.qos)
    if quarter > 1:
        assert not device.wait_for(lambda ms: len(ms) > window, timeout=1.0), "refilled before a quarter was acked"
    last = device.messages[quarter - 1]
    device.paho.ack(last.mid, last.qos)
    assert device.wait_for(lambda ms: len(ms) >= window + quarter), f"the ack of {quarter} refills {quarter}"
    assert not device.wait_for(lambda ms: len(ms) > window + quarter, timeout=0.5), "refilled more than a quarter"
    assert [m.payload for m in device.messages] == payloads(window + quarter), "in order, none twice"
    assert not any(m.dup for m in device.messages), "first sends carry no DUP"


# ------------------------------------------------------------------ guarantees.md: overflow and expiry lines


def test_drop_log_interval_0_logs_every_drop_naming_a_unicode_client_id_as_it_is(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `drop_log_interval` (finite number >= 0): "Seconds between two overflow warnings
    of one session (drops are always counted)"; guarantees.md: logged "at most once per
    `drop_log_interval` seconds per session: `session <id>: queue full at its limit of <n> messages
    (overflow <policy>): dropped <k> message(s) since the last warning, <total> in all`". With 0 no
    drop waits for a later line: three drops, three WARNINGs counting 1, 2 and 3 in all. `<id>` is the
    client id as the client wrote it."""
    broker = broker_factory(max_depth=2, max_depth_disconnected=2, overflow="drop-newest", drop_log_interval=0)
    queued_for_away_device(clients, broker, UNICODE_ID, 5)
    prefix = f"session {UNICODE_ID}: queue full at its limit of 2 messages (overflow drop-newest): "
    assert broker.wait_until(lambda: len([ln for ln in broker.log().splitlines() if prefix in ln]) >= 3, WAIT)
    lines = [line for line in broker.log().splitlines() if prefix in line]
    assert all("WARNING" in line for line in lines), lines
    tails = [line.split(prefix, 1)[1] for line in lines]
    assert tails == [f"dropped 1 message(s) since the last warning, {total} in all" for total in (1, 2, 3)]
    device = clients(broker.port, UNICODE_ID)
    assert [m.payload for m in device.wait_messages(2)] == payloads(2), "drop-newest kept the first two"


def test_the_expiry_line_and_event_name_a_unicode_client_id_as_it_is(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: "the broker logs a WARNING (`durable session <id> expired after <n> s
    disconnected: <m> queued message(s) and its subscriptions deleted`) and publishes, at QoS 1, on
    `$SYS/broker/durable/expired`: `{"client_id": "...", "messages_dropped": 12, "disconnected_at":
    1700000000.0}`"; "`session_expiry: 0` deletes a session as soon as it disconnects"; "A client that
    returns after expiry is a new client (session_present=0)"."""
    broker = broker_factory(session_expiry=0)
    watcher = clients(broker.port, "exp-watch", clean_session=True)
    assert watcher.subscribe("$SYS/broker/durable/expired", 1) == [1]
    device = clients(broker.port, UNICODE_ID)
    device.subscribe("exp/t", 1)
    before = time.time()
    device.disconnect()
    assert watcher.wait_for(lambda ms: len(ms) >= 1), "the expiry event"
    (event,) = watcher.messages
    assert event.qos == 1 and not event.retain
    body = json.loads(event.payload)
    assert body["client_id"] == UNICODE_ID and body["messages_dropped"] == 0
    assert isinstance(body["disconnected_at"], float) and before - 1 <= body["disconnected_at"] <= time.time() + 1
    ending = "expired after 0 s disconnected: 0 queued message(s) and its subscriptions deleted"
    expected = f"durable session {UNICODE_ID} {ending}"
    (line,) = wait_for_log(broker, f"durable session {UNICODE_ID} expired")
    assert "WARNING" in line and line.endswith(expected), line
    assert clients(broker.port, UNICODE_ID).session_present is False


# ------------------------------------------------------------------ guarantees.md: group commit with sync


def puback_time(client: Client, count: int) -> float:
    """Seconds from handing ``count`` QoS 1 publishes to paho in one go to the last one's PUBACK."""
    start = time.monotonic()
    infos = [client.paho.publish("gc/t", f"g{i}", qos=1) for i in range(count)]
    for info in infos:
        info.wait_for_publish(WAIT)
        assert info.is_published()
    return time.monotonic() - start


def test_with_sync_a_lone_publish_waits_batch_delay_ms_and_connects_subscribes_and_a_threshold_do_not(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Group commit: "with `sync: true` ... a commit ... starts: at once when
    `pending_threshold` ... or `batch_size` ... requests wait, otherwise `batch_delay_ms` ... after the
    first one"; "Connects, subscribes and a delivery pump about to send never wait for company"; "a lone
    publisher that waits for each PUBACK gets at most about `1000 / batch_delay_ms` messages per
    second". With a delay of 3 s (margins that hold on a loaded machine): a lone publish's PUBACK waits
    about that long; a durable CONNECT and a SUBSCRIBE (both stored before their answer) do not; nor do
    `pending_threshold` publishes in one write, nor `batch_size` ones while the threshold is higher."""
    delay = 3.0
    for threshold, batch, together in ((3, 5000, 3), (1000, 4, 4)):
        broker = broker_factory(sync=True, batch_delay_ms=delay * 1000, pending_threshold=threshold, batch_size=batch)
        start = time.monotonic()
        subscriber = clients(broker.port, f"gc-sub-{threshold}")
        assert subscriber.subscribe("gc/t", 1) == [1]
        assert time.monotonic() - start < delay * 0.6, "a durable CONNECT and SUBSCRIBE wait for no company"
        subscriber.disconnect()  # its queue is what each publish writes
        publisher = clients(broker.port, f"gc-pub-{threshold}", clean_session=True)
        puback_time(publisher, 1)  # joins the commit the subscriber's detach began: the next one is alone
        assert puback_time(publisher, 1) >= delay * 0.9, "a lone publish waits batch_delay_ms for company"
        assert puback_time(publisher, together) < delay * 0.6, f"{together} publishes in one write start a commit"
        broker.stop()


# ------------------------------------------------------------------ configuration.md: a lowered session limit


def durable_connack(port: int, client_id: str, *, clean: bool = False) -> int | None:
    """The CONNACK return code a raw CONNECT of ``client_id`` gets (None: closed without one); the
    connection is then ended with DISCONNECT."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(connect_packet(client_id, clean=clean))
        reply = sock.recv(4)
        with contextlib.suppress(OSError):
            sock.sendall(bytes((0xE0, 0)))
        return reply[3] if reply[:2] == b"\x20\x02" and len(reply) == 4 else None


def test_a_store_over_a_lowered_session_limit_keeps_them_all_and_takes_a_new_one_only_below_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `max_durable_sessions`: "A store that holds more (the limit was lowered) keeps
    them all and takes no new one until it holds fewer"; "A durable session's own reconnect is always
    accepted"; "a session that ends (... a clean CONNECT of its client id ...) frees its place at once";
    "logged as a WARNING naming the client id and the limit"."""
    broker = broker_factory()
    held = ["low-a", "low-b", "low-c"]
    for client_id in held:
        assert durable_connack(broker.port, client_id) == 0
    broker.stop()
    broker.settings["max_durable_sessions"] = 2
    broker.start()
    for client_id in held:
        device = clients(broker.port, client_id)
        assert device.session_present is True, f"{client_id}: kept over the lowered limit"
        device.disconnect()
    assert durable_connack(broker.port, "low-new-1") == 3, "3 held, limit 2"
    (line,) = wait_for_log(broker, "low-new-1")
    assert "WARNING" in line and "max_durable_sessions" in line and "2" in line.split("low-new-1", 1)[1], line
    assert durable_connack(broker.port, "low-a", clean=True) == 0, "a clean CONNECT ends low-a's session"
    assert durable_connack(broker.port, "low-new-2") == 3, "2 held, limit 2: still none new"
    assert durable_connack(broker.port, "low-b", clean=True) == 0
    assert durable_connack(broker.port, "low-new-3") == 0, "1 held: a new one is taken"
    assert durable_connack(broker.port, "low-new-4") == 3, "2 held again"
    assert durable_connack(broker.port, "low-c") == 0, "a session's own reconnect at the limit"


# ------------------------------------------------------------------ store-layout.md: repair's judgement of a folder


@pytest.mark.parametrize(
    ("keys", "accepted"),
    [
        ({b"i": bytes(8), b"user:1": b"alice"}, True),  # the store id `i` (an 8-byte value) alone decides
        ({b"i": bytes(7), b"user:1": b"alice"}, False),  # a 7-byte `i` is no store id
        ({b"s" + "dévice".encode(): b"{}", b"R\x00snapshot": b"", b"R": b""}, True),
        ({b"s\xff\xfe": b"{}"}, False),  # `s` followed by bytes that are not UTF-8
        ({b"R\x00snapshots": b""}, False),  # `R` NUL and something other than `snapshot`
        ({b"q" + bytes(17): b""}, False),  # `q` and 17 bytes
        ({b"w" + bytes(8): b"", b"m" + bytes(8): b"", b"c" + bytes(8): b"", b"x" + bytes(10): b""}, True),
    ],
    ids=["i-8-bytes", "i-7-bytes", "s-R-shapes", "s-not-utf8", "R-nul-other", "q-17-bytes", "w-m-c-x"],
)
def test_repair_takes_a_folder_by_its_8_byte_store_id_or_key_shapes_alone(
    tmp_path: Path, keys: dict[bytes, bytes], accepted: bool
) -> None:
    """store-layout.md: "`amqtt-durable repair` takes a LevelDB folder for a store of this plugin only
    when it holds `v` or the store id `i` (an 8-byte value), or when every key it holds has the shape
    of a key of this layout: `q` and 16 bytes; `t`, `w`, `m` or `c` and 8 bytes; `x` and 10 bytes; `v`,
    `i`, `n`, `M`, `R` and `R` NUL `snapshot` alone; `s`, `r` or `L` followed by UTF-8 ...". "It refuses
    another program's LevelDB without touching it"."""
    store = str(tmp_path / "store")
    db = plyvel.DB(store, create_if_missing=True)
    for key, value in keys.items():
        db.put(key, value)
    db.close()
    before = folder_digest(store)
    result = run_cli("repair", store)
    if accepted:
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "it is not an amqtt-durable store but another program's LevelDB" in result.stderr, result.stderr
        assert folder_digest(store) == before, "a file of the refused folder changed"


def test_the_expiry_line_gives_a_fractional_session_expiry_as_configured(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: the WARNING `durable session <id> expired after <n> s disconnected: <m>
    queued message(s) and its subscriptions deleted`, `<n>` being the session's expiry; configuration.md
    `session_expiry` accepts any "finite number >= 0", so 0.5 is said as 0.5 (not rounded to 0 s)."""
    broker = broker_factory(session_expiry=0.5)
    device = clients(broker.port, "half-second")
    device.subscribe("half/t", 1)
    device.disconnect()
    (line,) = wait_for_log(broker, "durable session half-second expired")
    ending = "expired after 0.5 s disconnected: 0 queued message(s) and its subscriptions deleted"
    assert line.endswith(f"durable session half-second {ending}"), line


# ------------------------------------------------------------------ guarantees.md: the subscription byte limit's line


def test_the_byte_limit_warning_names_client_unicode_filter_and_setting_once_per_interval_per_client(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Subscription limit: the broker "logs a WARNING naming the client, the filter and
    the setting, at most once per `drop_log_interval` seconds per client (the refusals in between are
    not logged)"; "The filters' UTF-8 bytes, summed per client, are bounded the same way by
    `max_subscription_bytes_per_client`". '温度/é' is 9 UTF-8 bytes: with 12 a client may hold it, and
    '温度/x' (8 more) is refused."""
    broker = broker_factory(max_subscription_bytes_per_client=12, drop_log_interval=60)
    first = clients(broker.port, "bytes-ä", clean_session=True)
    assert first.subscribe("温度/é", 1) == [1]
    assert first.subscribe("温度/x", 1) == [0x80]
    (line,) = wait_for_log(broker, "温度/x")
    assert " WARNING " in line and "bytes-ä" in line and "max_subscription_bytes_per_client" in line, line
    assert first.subscribe("y/温度", 1) == [0x80], "still over the limit"
    second = clients(broker.port, "bytes-ö", clean_session=False)
    assert second.subscribe([("温度/é", 1), ("温度/x", 0)]) == [1, 0x80]
    lines = [ln for ln in wait_for_log(broker, "bytes-ö") if "max_subscription_bytes_per_client" in ln]
    assert len(lines) == 1 and "温度/x" in lines[0], "another client's refusal has its own line"
    assert len([ln for ln in broker.log().splitlines() if "max_subscription_bytes_per_client" in ln]) == 2, (
        "the refusal of y/温度 within the interval is not logged"
    )
    assert not [ln for ln in broker.log().splitlines() if "y/温度" in ln]


# ------------------------------------------------------------------ configuration.md: attach_limit at its edge, 1


def test_with_one_attach_slot_a_storm_and_take_overs_deliver_every_queue_whole_in_order(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `attach_limit` (whole number >= 1): "Durable sessions attached to their new
    connection at once ... the others wait for a slot in the order they asked"; a durable connection
    waiting for its slot has its CONNACK, "but its SUBACK and its first message wait for its slot";
    guarantees.md: "No CONNECT starves", FIFO, and on a take-over "delivery continues on the new
    connection". With one slot: 12 sessions reconnecting at once each get their 15 queued messages in
    order, and take-overs of a connected session (whose attach also stops the old pump) each resume it."""
    broker = broker_factory(attach_limit=1)
    ids = [f"slot-{i}" for i in range(12)]
    for client_id in ids:
        device = clients(broker.port, client_id)
        device.subscribe(f"slot/{client_id}", 1)
        device.disconnect()
    publisher = clients(broker.port, "slot-pub", clean_session=True)
    for client_id in ids:
        publisher.publish(f"slot/{client_id}", payloads(15, client_id), qos=1)
    devices = [clients(broker.port, client_id, auto_start=False) for client_id in ids]
    threads = [threading.Thread(target=device.connect) for device in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    for device in devices:
        assert device.session_present is True
        assert [m.payload for m in device.wait_messages(15)] == payloads(15, device.client_id)
    assert devices[0].subscribe("slot/extra", 1) == [1], "a SUBACK once attached"
    for round_ in range(3):
        newer = clients(broker.port, "slot-0")
        assert newer.session_present is True
        publisher.publish("slot/extra", [f"x{round_}".encode()], qos=1)
        assert newer.wait_for(lambda ms, r=round_: any(m.payload == f"x{r}".encode() for m in ms)), round_


# ------------------------------------------------------------------ configuration.md: `store` folders refused untouched


@pytest.mark.parametrize(
    "files",
    [
        {"notes.txt": b"mine"},
        {"LOCK": b"", "LOG": b"", "notes.txt": b""},
        {"MANIFEST-000002": b"\x00" * 32, "000003.log": b"\x01" * 64, "LOCK": b""},
        {"000005.ldb": b"\x02" * 64},
    ],
    ids=["other-file", "lock-log-and-another", "manifest-and-log-without-current", "table-without-current"],
)
def test_a_store_folder_holding_other_files_or_leveldb_files_without_current_is_refused_untouched(
    tmp_path: Path, files: dict[str, bytes]
) -> None:
    """configuration.md `store`: "a new store is created only in a missing or empty folder (LevelDB's
    `LOCK`, `LOG` and `LOG.old` files alone ... count as empty; a folder holding other files, or
    LevelDB files without `CURRENT`, is refused untouched)"; settings are "checked at start-up": the
    broker does not start."""
    store = tmp_path / "store"
    store.mkdir()
    for name, data in files.items():
        (store / name).write_bytes(data)
    before = {path.name: path.read_bytes() for path in store.iterdir()}
    config = write_config(tmp_path, {"metrics_interval": 0})
    result = run_cli("broker", "-c", str(config))
    assert result.returncode != 0, result.stdout + result.stderr[-2000:]
    assert str(store) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert {path.name: path.read_bytes() for path in store.iterdir()} == before, "the folder was touched"


# ------------------------------------------------------------------ guarantees.md: PUBLISH topics that are not UTF-8


@pytest.mark.parametrize(
    "topic",
    [b"t/\xed\xa0\x80", b"t/\xc0\x80", b"t/\xe6\xb8", b"t/\xf4\x90\x80\x80"],
    ids=["surrogate", "overlong-nul", "cut-short", "past-u10ffff"],
)
def test_a_publish_whose_topic_is_not_strict_utf8_closes_the_connection_unanswered_on_either_reader(
    shared_reader: Broker, clients: Callable[..., Client], case_tag: str, topic: bytes
) -> None:
    """guarantees.md: "A PUBLISH to a topic no client may publish to closes the connection, at any QoS
    and on either reader ..., before anything is stored, routed or acknowledged (no PUBACK / PUBREC):
    ... bytes that are not valid UTF-8 ... A WARNING names the client and the problem." A UTF-16
    surrogate, an overlong NUL, a character cut short and one past U+10FFFF are not valid UTF-8. A
    topic of valid 4-byte characters and a BOM is routed and delivered byte for byte."""
    broker = shared_reader
    watcher = clients(broker.port, f"utf-watch-{case_tag}")
    assert watcher.subscribe("t/#", 1) == [1]
    with raw_connect(broker.port, f"utf-bad-{case_tag}", clean=True) as sock:
        sock.sendall(mqtt_packet(0x32, len(topic).to_bytes(2, "big") + topic + b"\x00\x07bad"))
        assert read_all(sock) == b"", "closed with no PUBACK"
    line = [ln for ln in wait_for_log(broker, f"utf-bad-{case_tag}") if "UTF-8" in ln]
    assert line and " WARNING " in line[0], broker.log()[-2000:]
    good = "t/😀\ufeff温"
    clients(broker.port, f"utf-good-{case_tag}", clean_session=True).publish(good, [b"ok"], qos=1)
    assert watcher.wait_for(lambda ms: len(ms) >= 1)
    assert [(m.topic, m.payload) for m in watcher.messages] == [(good, b"ok")], "only the valid topic was routed"


@pytest.mark.parametrize(
    ("configured", "asked", "shown"),
    [
        (300, 0.25, "0.25"),
        (300, 1 / 3, "0.3333333333333333"),  # not 15 digits' 0.333333333333333
        (300, 1.0, "1"),
        (0.30000000000000004, None, "0.30000000000000004"),  # the setting as written, not 0.3
    ],
)
def test_the_expiry_line_gives_the_expiry_as_set(
    broker_factory: Callable[..., Broker], configured: float, asked: float | None, shown: str
) -> None:
    """guarantees.md, Expiry: `<n>` of the WARNING is "the session's expiry as set, `session_expiry` or
    an SDK client's own"; protocol.md's `hello` asks for its own (the broker's 300) or takes the setting."""
    broker = broker_factory(session_expiry=configured)
    raw = Raw(broker.port, "own-expiry")
    with raw.sock:
        assert hello(raw, session_expiry=asked)["session_expiry"] == asked
        raw.sock.sendall(bytes((0xE0, 0)))
    (line,) = wait_for_log(broker, "durable session own-expiry expired")
    ending = f"expired after {shown} s disconnected: 0 queued message(s) and its subscriptions deleted"
    assert line.endswith(ending), line


# ------------------------------------------------------------------ guarantees.md: Owner, CONNECTs that arrive together


def test_of_users_connects_of_a_new_client_id_sent_together_the_first_accepted_owns_it_and_the_rest_get_5(
    broker: Broker,
) -> None:
    """guarantees.md, Owner: "Of two users' CONNECTs of a new client id that arrive together, the first
    one accepted creates the session and the other gets CONNACK 5, before anything is touched (the
    owner's connection stays up ...)"; with owner-only "a CONNECT of its client id by any other user
    ... is refused with CONNACK 5 ... and a WARNING names client id, user and owner". Five users here,
    every CONNECT written before any CONNACK is read."""
    users = [f"user-{i}" for i in range(5)]
    socks = {user: socket.create_connection((HOST, broker.port), timeout=WAIT) for user in users}
    try:
        for user, sock in socks.items():
            sock.sendall(connect_packet("shared-ü", clean=False, username=user))
        codes = {user: read_exactly(sock, 4) for user, sock in socks.items()}
        owners = [user for user, connack in codes.items() if connack == b"\x20\x02\x00\x00"]
        assert len(owners) == 1, codes
        (owner,) = owners
        assert all(codes[user] == b"\x20\x02\x00\x05" for user in users if user != owner), codes
        for user in users:
            if user != owner:
                assert read_all(socks[user]) == b"", f"{user}'s refused connection is closed"
        socks[owner].sendall(bytes((0xC0, 0)))
        assert read_exactly(socks[owner], 2) == b"\xd0\x00", "the owner's connection stays up"
        assert broker.wait_until(
            lambda: len([ln for ln in broker.log().splitlines() if "shared-ü" in ln and " WARNING " in ln]) >= 4, WAIT
        )
        lines = [ln for ln in broker.log().splitlines() if "shared-ü" in ln and " WARNING " in ln]
        for user in users:
            if user != owner:
                assert any(user in ln and owner in ln for ln in lines), (user, lines)
    finally:
        for sock in socks.values():
            sock.close()
    again = socket.create_connection((HOST, broker.port), timeout=WAIT)
    with again:
        again.sendall(connect_packet("shared-ü", clean=False, username=owner))
        assert read_exactly(again, 4) == b"\x20\x02\x01\x00", "the owner resumes its session"


# ------------------------------------------------------------------ guarantees.md: packet size, a CONNECT at the edge


def test_a_connect_exactly_max_packet_size_long_is_accepted_and_one_byte_more_is_closed_unanswered(
    broker_factory: Callable[..., Broker],
) -> None:
    """configuration.md `max_packet_size` (1024 to 268435455): "Largest packet a client may send
    (remaining length, bytes); a larger one closes the connection before its body is read";
    guarantees.md: "(CONNECT included)". A CONNECT's remaining length is 12 bytes plus its client id's:
    an id of 1012 bytes (2-byte characters included) makes it exactly 1024."""
    broker = broker_factory(max_packet_size=1024)
    exact = "é" * 6 + "x" * 1000  # 1012 UTF-8 bytes
    packet = connect_packet(exact, clean=False)
    assert packet[1:3] == b"\x80\x08", "remaining length 1024"
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(packet)
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    over = connect_packet(exact + "y", clean=False)
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(over)
        assert read_all(sock) == b"", "closed without a CONNACK"
    assert broker.wait_until(
        lambda: any("1025" in ln and "1024" in ln and " WARNING " in ln for ln in broker.log().splitlines()), WAIT
    ), broker.log()[-2000:]
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(packet)
        assert read_exactly(sock, 4) == b"\x20\x02\x01\x00", "the 1024-byte CONNECT's session was stored"


# ------------------------------------------------------------------ guarantees.md: session_expiry 0 and a take-over


def test_with_session_expiry_0_a_take_over_is_no_disconnect_and_the_session_stays(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md: "`session_expiry: 0` deletes a session as soon as it disconnects"; a take-over is
    not a disconnect: "a second connection with the same client id ... takes the session over ...;
    delivery continues on the new connection, unacknowledged messages first". Three take-overs in a row
    each find the session (session_present 1) and its subscription, and nothing expires."""
    broker = broker_factory(session_expiry=0)
    first = clients(broker.port, "zero-take")
    assert first.subscribe("zt/t", 1) == [1]
    publisher = clients(broker.port, "zero-pub", clean_session=True)
    for round_ in range(3):
        newer = clients(broker.port, "zero-take")
        assert newer.session_present is True, round_
        publisher.publish("zt/t", [f"r{round_}".encode()], qos=1)
        assert newer.wait_for(lambda ms, r=round_: any(m.payload == f"r{r}".encode() for m in ms)), round_
    assert "durable session zero-take expired" not in broker.log()
    newer.disconnect()
    wait_for_log(broker, "durable session zero-take expired after 0 s")
