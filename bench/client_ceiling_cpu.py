"""Is the raw subscriber the ceiling of Mosquitto's replay?  CPU of the subscriber process and of the
broker over the replay (from the subscriber's 'ready' = CONNACK to its result), per run.  Ad hoc (helper uvloop)."""

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_durable as bd
import psutil
from _common import CLIENT_START_S, MOSQUITTO, OURS, RESULT_MARGIN_S
from _harness import Ctx, Results, build_brokers, drop_session, sub_spec, warmup
from _rawmqtt import ClientProcess, subscriber_main


def cpu(pid):
    c = psutil.Process(pid).cpu_times()
    return c.user + c.system


def main():
    args = bd.parse_args(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="uvceil_") as t:
        tmp = Path(t)
        brokers, store = build_brokers(args, tmp, mosquitto="/usr/sbin/mosquitto")
        brokers.pop("stock")
        ctx = Ctx(args, tmp, brokers[OURS].login, Results(), brokers, store, args.client_cpus if args.pin else None)
        rows = {}
        try:
            for b in brokers.values():
                b.start(60)
                warmup(ctx, b)
            for r in range(args.runs):
                for name in (MOSQUITTO, OURS) if r % 2 == 0 else (OURS, MOSQUITTO):
                    b = brokers[name]
                    n = args.n
                    tag = ctx.tag()
                    topic, sub_id, pub_id = ctx.ids("ceil", b.name, tag)
                    bd.durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
                    bd.publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=args.timeout)
                    spec = sub_spec(
                        ctx, b, sub_id=sub_id, tag=tag, n=n, timeout=args.timeout, idle=args.idle, need_session=True
                    )
                    with ClientProcess(f"{b.name} subscriber", subscriber_main, spec) as sub:
                        sub.expect("ready", CLIENT_START_S)
                        s0, b0 = cpu(sub.proc.pid), cpu(b.pid)
                        res = sub.expect("result", spec.timeout + RESULT_MARGIN_S)
                        s1, b1 = cpu(sub.proc.pid), cpu(b.pid)
                    drop_session(ctx, b, sub_id)
                    wall = (res.t_last_ns - res.t_connack_ns) / 1e9
                    rate = res.unique / ((res.t_last_ns - res.t_connect_ns) / 1e9)
                    row = rows.setdefault(name, [])
                    row.append((rate, (s1 - s0) / wall, (b1 - b0) / wall))
                    print(
                        f"run {r + 1} {name}: replay {rate:,.0f} msgs/s over {wall:.2f}s; subscriber CPU "
                        f"{100 * (s1 - s0) / wall:.0f}% of a core, broker CPU {100 * (b1 - b0) / wall:.0f}% "
                        f"({res.unique}/{n})",
                        flush=True,
                    )
        finally:
            for b in brokers.values():
                b.stop(30)
    for name, row in rows.items():
        print(
            name,
            "median rate",
            f"{statistics.median(x[0] for x in row):,.0f}",
            "sub cpu",
            f"{statistics.median(x[1] for x in row):.2f}",
            "broker cpu",
            f"{statistics.median(x[2] for x in row):.2f}",
        )


if __name__ == "__main__":
    main()
