"""Synthetic delivery logs (docs/delivery-log.md) with planted faults, for tests and benchmarks.

A ring of ``devices`` devices: device ``i`` publishes ``messages`` QoS 1 messages on
``fleet/dev-i/telemetry`` every 10 ms and subscribes (durably, QoS 1) to the next device's
topic, by the exact topic, ``.../+`` or ``.../#`` in turn. Each device also sends one message
before its subscriber subscribed (not expected), goes away for about a third of the run and
reconnects: what was sent meanwhile is received replayed, then a ``live`` record, then live
receives. At the end each receiver unsubscribes (even devices) or ends its session (odd ones),
and its publisher sends one more message (not expected). Every record kind is there (send,
receive, subscribe, unsubscribe, session_end, connect, live).

Faults are planted per receiving device on disjoint messages: ``lose`` (fraction of deliveries
whose receive is missing), ``duplicate`` (received twice, the second flagged redelivered) and
``reorder`` (two consecutive messages received swapped: one out of order each). The returned
:class:`SyntheticLogs` has the exact counts the audit must find.

``repeat`` makes a fraction of the payloads repeat the payload sent two messages before (a
switch toggling ON, OFF, ON, ...: the same message id again). The faults are then planted apart
(each lost message and each swapped pair has two untouched messages on either side, and a swapped
message is not repeated by the message after the pair), so the planted faults remain the only
reading of the logs: a lost copy is told from the next one by the message received between them.

Columns are built with numpy and written with pyarrow in chunks (Parquet) or pandas (JSON
lines), so ten million records take seconds, not a Python loop per record.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

START = 1_700_000_000.0
INTERVAL = 0.01
"""Seconds between two sends of a device."""
CHUNK_RECORDS = 1_000_000
"""About this many records are built and written at once."""


@dataclass(frozen=True)
class DeviceTruth:
    """What the audit must find for one receiving device."""

    expected: int
    received: int
    lost: int
    duplicated: int
    out_of_order: int
    replayed: int
    repeated: int = 0
    """Not found by the audit: messages whose payload repeats an earlier one (``repeat``)."""
    repeated_lost: int = 0
    """Not found by the audit: lost messages whose payload was sent more than once."""


@dataclass(frozen=True)
class _Plan:
    """Fractions of each device's deliveries to spoil, and the seed that picks them."""

    lose: float
    duplicate: float
    reorder: float
    repeat: float
    seed: int


@dataclass(frozen=True)
class SyntheticLogs:
    """The written file and the truth per receiving device."""

    path: Path
    records: int
    devices: dict[str, DeviceTruth]

    @property
    def total(self) -> DeviceTruth:
        def total(name: str) -> int:
            return sum(getattr(truth, name) for truth in self.devices.values())

        return DeviceTruth(**{name: total(name) for name in DeviceTruth.__dataclass_fields__})


def device_name(index: int) -> str:
    return f"dev-{index:05d}"


def message_id(topic: str, payload: bytes) -> str:
    """docs/delivery-log.md: the first 16 bytes of SHA-256 over topic, NUL, payload, in hex."""
    return hashlib.sha256(topic.encode("utf-8") + b"\x00" + payload).hexdigest()[:32]


def write_logs(
    path: str | Path,
    devices: int,
    messages: int,
    *,
    lose: float = 0.0,
    duplicate: float = 0.0,
    reorder: float = 0.0,
    repeat: float = 0.0,
    seed: int = 0,
) -> SyntheticLogs:
    """Write the ring's logs to ``path`` (``*.parquet``: Parquet, ``*.jsonl``/``*.json``: JSON lines).

    ``lose``/``duplicate``/``reorder`` are fractions of each device's deliveries (rounded per
    device; ``reorder`` swaps pairs, at most one per two messages); ``repeat`` the fraction of
    payloads that repeat the one sent two messages before (the faults are then fewer where they
    would not fit apart from one another: the truth has the counts planted).
    """
    target = Path(path)
    as_parquet = target.suffix == ".parquet"
    if not as_parquet and target.suffix not in (".jsonl", ".json"):
        raise ValueError(f"write_logs writes *.parquet or *.jsonl, not {target.name}")
    if devices < 1 or messages < 1:
        raise ValueError("write_logs needs at least one device and one message")
    for name, fraction in (("lose", lose), ("duplicate", duplicate), ("reorder", reorder), ("repeat", repeat)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} is a fraction of the messages, in [0, 1], not {fraction}")
    plan = _Plan(lose=lose, duplicate=duplicate, reorder=reorder, repeat=repeat, seed=seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    writer = _ParquetSink(target) if as_parquet else _JsonSink(target)
    truth: dict[str, DeviceTruth] = {}
    records = 0
    per_chunk = max(1, CHUNK_RECORDS // (2 * messages + 8))
    try:
        for first in range(0, devices, per_chunk):
            batch = _Batch()
            for receiver in range(first, min(devices, first + per_chunk)):
                truth[device_name(receiver)] = _pair(batch, receiver, devices, messages, plan)
            records += writer.write(batch)
    finally:
        writer.close()
    return SyntheticLogs(path=target, records=records, devices=truth)


class _Batch:
    """Columns per kind, appended pair by pair and concatenated once per chunk."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, list[Any]]] = {}

    def add(self, kind: str, **columns: Any) -> None:
        part = self.parts.setdefault(kind, {})
        for name, values in columns.items():
            part.setdefault(name, []).append(np.asarray(values))

    def tables(self) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
        return {
            kind: {name: np.concatenate(chunks) for name, chunks in cols.items()} for kind, cols in self.parts.items()
        }


def _pair(batch: _Batch, receiver: int, devices: int, messages: int, plan: _Plan) -> DeviceTruth:
    """The records of one delivery stream: device ``receiver + 1`` publishes, ``receiver`` receives."""
    rng = np.random.default_rng([plan.seed, receiver])
    publisher = (receiver + 1) % devices
    rname, pname = device_name(receiver), device_name(publisher)
    topic = f"fleet/{pname}/telemetry"
    topic_filter = (topic, f"fleet/{pname}/+", f"fleet/{pname}/#")[receiver % 3]
    base = START + 0.0005 * receiver
    sub_time = base + 0.5
    send_time = base + 1.0 + INTERVAL * np.arange(messages)
    payload = _payloads(np.random.default_rng([plan.seed, receiver, 1]), messages, plan.repeat)
    ids = np.array([message_id(topic, f"{publisher}:{k}".encode()) for k in payload])
    run = INTERVAL * messages
    u = rng.random()
    off_start, off_end = base + 1.0 + (0.3 + 0.1 * u) * run, base + 1.0 + (0.6 + 0.1 * u) * run
    replayed = (send_time >= off_start) & (send_time < off_end)
    n_replayed = int(replayed.sum())
    replay_start = off_end + 0.05
    drain_end = replay_start + n_replayed * 0.0002
    recv_time = send_time + 0.002 + 0.003 * rng.random(messages)
    recv_time[replayed] = replay_start + 0.0002 * np.arange(n_replayed)
    after = send_time >= off_end
    recv_time[after] = np.maximum(recv_time[after], drain_end + 1e-4 * np.arange(1, int(after.sum()) + 1))
    seq = np.arange(1, messages + 1, dtype=np.int64)

    if plan.repeat:
        lost, dup, swaps = _faults_apart(rng, replayed, ids, plan)
    else:
        lost, dup, swaps = _faults(rng, replayed, plan)
    for k in swaps:
        recv_time[[k, k + 1]] = recv_time[[k + 1, k]]
        seq[[k, k + 1]] = seq[[k + 1, k]]
    keep = np.ones(messages, dtype=bool)
    keep[lost] = False
    rows = np.concatenate([np.flatnonzero(keep), dup])
    redelivered = np.concatenate([np.zeros(int(keep.sum()), dtype=bool), np.ones(len(dup), dtype=bool)])
    times = recv_time[rows] + np.where(redelivered, 5e-6, 0.0)

    early_id = message_id(topic, f"{publisher}:early".encode())
    late_id = message_id(topic, f"{publisher}:late".encode())
    close_time = float(times.max(initial=send_time[-1])) + 0.01
    batch.add(
        "send",
        device=np.full(messages + 2, pname),
        time=np.concatenate([[sub_time - 0.3], send_time, [close_time + 0.01]]),
        topic=np.full(messages + 2, topic),
        id=np.concatenate([[early_id], ids, [late_id]]),
        qos=np.ones(messages + 2, dtype=np.int32),
    )
    batch.add(
        "receive",
        device=np.full(len(rows), rname),
        time=times,
        topic=np.full(len(rows), topic),
        id=ids[rows],
        qos=np.ones(len(rows), dtype=np.int32),
        replayed=replayed[rows],
        redelivered=redelivered,
        seq=seq[rows],
        epoch=np.ones(len(rows), dtype=np.int64),
        published_at=send_time[rows] + 0.001,
    )
    batch.add(
        "subscribe", device=[rname], time=[sub_time], topic=[topic_filter], qos=np.array([1], np.int32), durable=[True]
    )
    values, counts = np.unique(ids, return_counts=True)
    if receiver % 2 == 0:
        batch.add("unsubscribe", device=[rname], time=[close_time], topic=[topic_filter])
    else:
        batch.add("session_end", device=[rname], time=[close_time])
    batch.add("connect", device=[rname, rname], time=[base, off_end], session_present=[False, True])
    batch.add(
        "live", device=[rname, rname], time=[sub_time + 0.0005, drain_end], replayed_count=np.array([0, n_replayed])
    )
    return DeviceTruth(
        expected=messages,
        received=len(rows),
        lost=len(lost),
        duplicated=len(dup),
        out_of_order=len(swaps),
        replayed=int(replayed[rows].sum()),
        repeated=messages - len(np.unique(payload)),
        repeated_lost=int(np.isin(ids[lost], values[counts > 1]).sum()),
    )


def _faults(
    rng: np.random.Generator, replayed: np.ndarray[Any, Any], plan: _Plan
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], list[int]]:
    """Disjoint message indexes: lost, duplicated, and the first of each swapped pair."""
    messages = len(replayed)
    order = rng.permutation(messages)
    n_lost, n_dup = round(plan.lose * messages), round(plan.duplicate * messages)
    lost, dup = np.sort(order[:n_lost]), np.sort(order[n_lost : n_lost + n_dup])
    taken = np.zeros(messages, dtype=bool)
    taken[order[: n_lost + n_dup]] = True
    firsts = np.arange(0, messages - 1, 2)
    ok = ~taken[firsts] & ~taken[firsts + 1] & (replayed[firsts] == replayed[firsts + 1])
    candidates = firsts[ok]
    swaps = np.sort(rng.permutation(candidates)[: min(len(candidates), round(plan.reorder * messages))])
    return lost, dup, [int(k) for k in swaps]


def _payloads(rng: np.random.Generator, messages: int, repeat: float) -> np.ndarray[Any, Any]:
    """Per message, the number its payload is made of: its own, or (``repeat``) that of two before."""
    payload = np.arange(messages)
    chosen = rng.permutation(np.arange(2, messages))[: round(repeat * max(0, messages - 2))]
    for k in np.sort(chosen):  # ascending: a copy of a copy carries the first payload of the chain
        payload[k] = payload[k - 2]
    return payload


def _faults_apart(
    rng: np.random.Generator, replayed: np.ndarray[Any, Any], ids: np.ndarray[Any, Any], plan: _Plan
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], list[int]]:
    """As :func:`_faults`, for repeated payloads: each lost message and swapped pair with two
    untouched messages on either side, the two swapped messages of different payloads, and the
    first not repeated right after the pair. Then every receive can only be the message planted:
    the message received between a lost copy and the next copy places that copy."""
    messages = len(replayed)
    faulted = np.zeros(messages, dtype=bool)

    def apart(first: int, last: int) -> bool:
        return not faulted[max(0, first - 2) : last + 3].any()

    lost: list[int] = []
    for m in rng.permutation(messages):
        if len(lost) == round(plan.lose * messages):
            break
        if apart(int(m), int(m)):
            faulted[m] = True
            lost.append(int(m))
    free = [int(m) for m in rng.permutation(messages) if not faulted[m]]
    dup = np.sort(np.array(free[: round(plan.duplicate * messages)], dtype=np.int64))
    duplicated = np.zeros(messages, dtype=bool)
    duplicated[dup] = True
    swaps: list[int] = []
    for k in (int(k) for k in rng.permutation(max(0, messages - 1))):
        if len(swaps) == round(plan.reorder * messages):
            break
        repeated_after = k + 2 < messages and ids[k + 2] == ids[k]
        if (
            apart(k, k + 1)
            and not duplicated[k : k + 2].any()
            and replayed[k] == replayed[k + 1]
            and ids[k] != ids[k + 1]
            and not repeated_after
        ):
            faulted[k : k + 2] = True
            swaps.append(k)
    return np.sort(np.array(lost, dtype=np.int64)), dup, sorted(swaps)


_TYPES = {
    "kind": "string",
    "device": "string",
    "time": "float64",
    "topic": "string",
    "id": "string",
    "qos": "int32",
    "replayed": "bool",
    "redelivered": "bool",
    "seq": "int64",
    "epoch": "int64",
    "published_at": "float64",
    "durable": "bool",
    "session_present": "bool",
    "replayed_count": "int64",
}


class _ParquetSink:
    """One Parquet file, a row group per chunk, every documented column (null where not used)."""

    def __init__(self, path: Path) -> None:

        self.schema = pa.schema([(name, pa.type_for_alias(alias)) for name, alias in _TYPES.items()])
        self.writer = pq.ParquetWriter(str(path), self.schema)

    def write(self, batch: _Batch) -> int:

        tables = []
        for kind, columns in batch.tables().items():
            size = len(columns["device"])
            arrays = [
                pa.array(np.full(size, kind))
                if name == "kind"
                else pa.array(columns[name], type=self.schema.field(name).type)
                if name in columns
                else pa.nulls(size, type=self.schema.field(name).type)
                for name in _TYPES
            ]
            tables.append(pa.Table.from_arrays(arrays, schema=self.schema))
        table = pa.concat_tables(tables)
        self.writer.write_table(table)
        return int(table.num_rows)

    def close(self) -> None:
        self.writer.close()


class _JsonSink:
    """JSON lines as the SDK writes them: each record has only its kind's columns."""

    def __init__(self, path: Path) -> None:
        self.handle = path.open("a", encoding="utf-8")

    def write(self, batch: _Batch) -> int:

        written = 0
        for kind, columns in batch.tables().items():
            size = len(columns["device"])
            frame = pa.table({"kind": np.full(size, kind), **columns}).to_pandas()
            text = frame.to_json(orient="records", lines=True, double_precision=10)
            self.handle.write(text if text.endswith("\n") else text + "\n")
            written += size
        return written

    def close(self) -> None:
        self.handle.close()
