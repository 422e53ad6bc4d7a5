"""Paired A/B: ours on uvloop and ours on asyncio, both pinned to CPU 0, driven at the same time
(clients on CPU 1), so whatever else loads the machine loads both alike.  Per phase: broker CPU
(user+sys, all threads) per message and the rate.  (a) live, (b) offline enqueue, (c) replay.
Ad hoc (helper uvloop)."""

import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_durable as bd
import psutil
from _common import OURS, OURS_ASYNCIO
from _harness import Ctx, Results, build_brokers, drop_session, live_run, warmup


def cpu(pid):
    c = psutil.Process(pid).cpu_times()
    return c.user + c.system


def both(fn, brokers):
    out, errs = {}, []

    def run(name):
        try:
            out[name] = fn(brokers[name])
        except Exception as exc:
            errs.append(exc)

    ts = [threading.Thread(target=run, args=(n,)) for n in brokers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    if errs:
        raise errs[0]
    return out


def main():
    args = bd.parse_args(sys.argv[1:])
    n = args.n
    with tempfile.TemporaryDirectory(prefix="uvpair_") as t:
        tmp = Path(t)
        brokers, store = build_brokers(args, tmp, asyncio_loop=True)
        brokers.pop("stock")
        ctx = Ctx(args, tmp, brokers[OURS].login, Results(), brokers, store, args.client_cpus if args.pin else None)
        rows = {OURS: {}, OURS_ASYNCIO: {}}

        def add(name, k, v):
            rows[name].setdefault(k, []).append(v)

        try:
            for b in brokers.values():
                b.start(60)
                warmup(ctx, b)
            for r in range(args.runs):
                c0 = {k: cpu(b.pid) for k, b in brokers.items()}
                live = both(lambda b: live_run(ctx, b, scenario="a", n=n, clean=False, record_latency=False), brokers)
                c1 = {k: cpu(b.pid) for k, b in brokers.items()}
                for name, (pr, rr, sub_id) in live.items():
                    drop_session(ctx, brokers[name], sub_id)
                    add(name, "a", rr.unique / ((rr.t_last_ns - pr.t_first_send_ns) / 1e9))
                    add(name, "a_us", (c1[name] - c0[name]) / n * 1e6)
                ids = {}
                for name, b in brokers.items():
                    tag = ctx.tag()
                    topic, sub_id, pub_id = ctx.ids("bc", name, tag)
                    bd.durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
                    ids[name] = (tag, topic, sub_id, pub_id)
                c2 = {k: cpu(b.pid) for k, b in brokers.items()}
                pubs = both(
                    lambda b, ids=ids: bd.publish(
                        ctx,
                        b,
                        pub_id=ids[b.name][3],
                        topic=ids[b.name][1],
                        tag=ids[b.name][0],
                        n=n,
                        timeout=args.timeout,
                    ),
                    brokers,
                )
                c3 = {k: cpu(b.pid) for k, b in brokers.items()}
                recs = both(
                    lambda b, ids=ids: bd.reconnect_and_receive(ctx, b, sub_id=ids[b.name][2], tag=ids[b.name][0], n=n),
                    brokers,
                )
                c4 = {k: cpu(b.pid) for k, b in brokers.items()}
                for name in brokers:
                    drop_session(ctx, brokers[name], ids[name][2])
                    pr, rr = pubs[name], recs[name]
                    add(name, "b", pr.ack_rate)
                    add(name, "b_us", (c3[name] - c2[name]) / n * 1e6)
                    add(name, "c", rr.unique / ((rr.t_last_ns - rr.t_connect_ns) / 1e9))
                    add(name, "c_first", (rr.t_first_ns - rr.t_connect_ns) / 1e6)
                    add(name, "c_us", (c4[name] - c3[name]) / n * 1e6)
                    assert rr.unique == n and pr.acked == n, (name, rr.unique, pr.acked)
                print(
                    f"round {r + 1}: "
                    + "; ".join(
                        f"{name}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in rows[name].items()) for name in rows
                    ),
                    flush=True,
                )
        finally:
            for b in brokers.values():
                b.stop(30)
    print("\nmedians (uvloop | asyncio | uvloop/asyncio):")
    for k in rows[OURS]:
        u, a = statistics.median(rows[OURS][k]), statistics.median(rows[OURS_ASYNCIO][k])
        print(f"  {k}: {u:,.1f} | {a:,.1f} | {u / a:.3f}")
    for k in rows[OURS]:
        ratios = [x / y for x, y in zip(rows[OURS][k], rows[OURS_ASYNCIO][k], strict=True)]
        print(f"  per-round ratio {k}: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
