"""Synthetic delivery logs (docs/delivery-log.md) with planted faults, for tests and benchmarks.

A ring of ``devices`` devices: device ``i`` publishes ``messages`` QoS 1 messages on
``fleet/dev-i/telemetry`` every 10 ms and subscribes (durably, QoS 1) to the next device's
topic, by the exact topic, ``.../+`` or ``.../#`` in turn. Each device also sends one message
before its subscriber subscribed (not expected), goes away for about a third of the run and
reconnects: what was sent meanwhile is received replayed, then a ``live`` record, then live
receives. Every record kind is there (send, receive, subscribe, connect, live).

Faults are planted per receiving device on disjoint messages: ``lose`` (fraction of deliveries
whose receive is missing), ``duplicate`` (received twice, the second flagged redelivered) and
``reorder`` (two consecutive messages received swapped: one out of order each). The returned
:class:`SyntheticLogs` has the exact counts the audit must find.

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


@dataclass(frozen=True)
class _Plan:
    """Fractions of each device's deliveries to spoil, and the seed that picks them."""

    lose: float
    duplicate: float
    reorder: float
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
    seed: int = 0,
) -> SyntheticLogs:
    """Write the ring's logs to ``path`` (``*.parquet``: Parquet, ``*.jsonl``/``*.json``: JSON lines).

    ``lose``/``duplicate``/``reorder`` are fractions of each device's deliveries (rounded per
    device; ``reorder`` swaps pairs, at most one per two messages).
    """
    target = Path(path)
    as_parquet = target.suffix == ".parquet"
    if not as_parquet and target.suffix not in (".jsonl", ".json"):
        raise ValueError(f"write_logs writes *.parquet or *.jsonl, not {target.name}")
    if devices < 1 or messages < 1:
        raise ValueError("write_logs needs at least one device and one message")
    for name, fraction in (("lose", lose), ("duplicate", duplicate), ("reorder", reorder)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} is a fraction of the messages, in [0, 1], not {fraction}")
    plan = _Plan(lose=lose, duplicate=duplicate, reorder=reorder, seed=seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    writer = _ParquetSink(target) if as_parquet else _JsonSink(target)
    truth: dict[str, DeviceTruth] = {}
    records = 0
    per_chunk = max(1, CHUNK_RECORDS // (2 * messages + 6))
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
    ids = np.array([message_id(topic, f"{publisher}:{k}".encode()) for k in range(messages)])
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
    batch.add(
        "send",
        device=np.full(messages + 1, pname),
        time=np.concatenate([[sub_time - 0.3], send_time]),
        topic=np.full(messages + 1, topic),
        id=np.concatenate([[early_id], ids]),
        qos=np.ones(messages + 1, dtype=np.int32),
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
