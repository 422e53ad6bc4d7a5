"""The replication channel alone (issue 12, first round; not yet the broker): a primary and
two backups in this process, real LevelDB stores in a temporary folder, TCP on 127.0.0.1.

Measures batches acknowledged by both backups (which fsync each write) per second, with one
batch in flight and with 100, and a snapshot catch-up from empty; then the same with
``replication.secret`` (the HMAC handshake of auth.py), mutual TLS, and both, side by side,
plus the cost of one connection's handshake (a tool's STATUS question, asked 200 times). Run:
``python bench/bench_replication_channel.py`` (``--security plain`` for the first part alone;
the TLS rows need ``trustme``, in the test extras). ``--frames`` measures only the per-frame cost
of the secret's MAC (auth.Session): encoding, and reading from an in-memory stream, 40,000 BATCH
frames of one small commit, plain and MACed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import ssl
import tempfile
import time
from pathlib import Path

from amqtt_durable.replication.auth import Session
from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.config import TlsConfig
from amqtt_durable.replication.framing import Frame, Op, encode_batch
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask
from amqtt_durable.store import STORE_ID_KEY, open_store

HOST = "127.0.0.1"
BATCHES = 20_000
ASKS = 200
SECRET = b"bench-secret-0123456789abcdef"


def ops_for(n: int) -> list[Op]:
    """A commit like one publish's: a 64-byte body, a queue entry, the queue's totals."""
    return [
        (b"m" + n.to_bytes(8, "big"), bytes(64)),
        (b"q" + (n % 7).to_bytes(8, "big") + n.to_bytes(8, "big"), bytes(14)),
        (b"t" + (n % 7).to_bytes(8, "big"), bytes(24)),
    ]


def commit(primary: Primary, ops: list[Op]) -> asyncio.Future[None]:
    prepared = primary.prepare(ops)
    with primary.db.write_batch() as batch:
        for key, value in prepared.ops:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
    return primary.committed(prepared)


def tls_contexts(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    import trustme  # noqa: PLC0415 - the test extras; only for the TLS rows

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    ca.issue_cert(HOST).private_key_and_cert_chain_pem.write_to_path(str(folder / "node.pem"))
    tls = TlsConfig(cert=str(folder / "node.pem"), ca=str(folder / "ca.pem"))
    return tls.context(server=True), tls.context(server=False)


async def run(folder: Path, window: int, security: str) -> None:
    secret = SECRET if "secret" in security else None
    server_tls, client_tls = tls_contexts(folder) if "tls" in security else (None, None)
    db = open_store(str(folder / "p"))
    db.put(STORE_ID_KEY, secrets.randbits(63).to_bytes(8, "big"))
    primary = Primary(db, store_id=int.from_bytes(db.get(STORE_ID_KEY), "big"), log_max_batches=100_000,
                      log_max_bytes=64 << 20, secret=secret)
    primary.on_admin = lambda kind: {}
    await primary.start(HOST, 0, server_tls)
    stop = asyncio.Event()
    backups = [Backup(open_store(str(folder / f"b{i}")), name=f"b{i}", secret=secret, tls=client_tls)
               for i in range(2)]
    tasks = [asyncio.create_task(b.follow(HOST, primary.port, stop)) for b in backups]
    for backup in backups:
        await asyncio.wait_for(backup.in_sync_event.wait(), 30)
    started = time.perf_counter()
    pending: list[asyncio.Future[None]] = []
    for n in range(1, BATCHES + 1):
        pending.append(commit(primary, ops_for(n)))
        if len(pending) >= window:
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            pending = []
    await asyncio.wait_for(asyncio.gather(*pending), 30)
    took = time.perf_counter() - started
    print(f"[{security}] {BATCHES} batches, {window} in flight: {took:.2f} s, "
          f"{BATCHES / took:,.0f} batches/s acked by 2 backups")
    rows = sum(1 for _ in db.iterator(include_value=False))
    late = Backup(open_store(str(folder / "late")), name="late", secret=secret, tls=client_tls)
    started = time.perf_counter()
    tasks.append(asyncio.create_task(late.follow(HOST, primary.port, stop)))
    await asyncio.wait_for(late.in_sync_event.wait(), 60)
    took = time.perf_counter() - started
    print(f"  snapshot catch-up from empty, {rows} rows: {took:.2f} s, {rows / took:,.0f} rows/s")
    started = time.perf_counter()
    for _ in range(ASKS):
        await ask(f"{HOST}:{primary.port}", Frame.STATUS, secret, client_tls)
    took = time.perf_counter() - started
    print(f"  {ASKS} connections with a STATUS question each: {took * 1000 / ASKS:.2f} ms per connection")
    stop.set()
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await primary.close()


async def frames() -> None:
    data, _ = encode_batch(5, 1, ops_for(5))
    count = 40_000
    for label, session, reading in (
        ("plain", Session(), Session()),
        ("secret", Session(send_key=SECRET), Session(recv_key=SECRET)),
    ):
        started = time.perf_counter()
        stream = b"".join(session.encode(Frame.BATCH, data) for _ in range(count))
        encoded = time.perf_counter()
        reader = asyncio.StreamReader()
        reader.feed_data(stream)
        reader.feed_eof()
        for _ in range(count):
            await reading.read(reader)
        read = time.perf_counter()
        print(f"[{label}] {count} BATCH frames of {len(data)} bytes: "
              f"encode {(encoded - started) * 1e6 / count:.2f} us, "
              f"read {(read - encoded) * 1e6 / count:.2f} us per frame")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--security", nargs="*", default=["plain", "secret", "tls", "secret+tls"],
                        choices=["plain", "secret", "tls", "secret+tls"])
    parser.add_argument("--frames", action="store_true", help="only the per-frame cost of the MAC")
    args = parser.parse_args()
    if args.frames:
        asyncio.run(frames())
        return
    for window in (1, 100):
        for security in args.security:
            with tempfile.TemporaryDirectory() as folder:
                asyncio.run(run(Path(folder), window, security))


if __name__ == "__main__":
    main()
