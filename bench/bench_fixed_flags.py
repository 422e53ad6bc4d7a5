"""Per-packet cost of FastReader's fixed header flags check (review 131, point 2), in ns per packet.

"before": branch audit-core at 423fd12 called ``fixed_flags_problem(first >> 4, first & 0x0F)`` in
``_dispatch_all`` for every packet, PUBLISH and acks included (its body is reproduced here: it is
gone). "now": a PUBLISH and an ack in a run are not looked up at all; any other packet costs
``_BAD_FIRST[first]``. Each figure is timeit's best of 7 minus the cost of evaluating ``first`` alone.

    PYTHONPATH=plugin .venv/bin/python bench/bench_fixed_flags.py
"""

from __future__ import annotations

import timeit
from typing import Any

from amqtt.mqtt.packet import PUBLISH, RESERVED_0, RESERVED_15

from amqtt_durable import amqtt_glue
from amqtt_durable.errors import ProtocolViolationError

N = 2_000_000
CASES = {
    "PUBLISH QoS 1 (0x32)": (0x32, False),
    "PUBACK (0x40)": (0x40, False),
    "PINGREQ (0xc0)": (0xC0, True),
    "SUBSCRIBE (0x82)": (0x82, True),
}
"""First byte, and whether FastReader now looks it up in _BAD_FIRST."""


def fixed_flags_problem(packet_type: int, flags: int) -> ProtocolViolationError | None:
    """423fd12's check, as it was."""
    if packet_type in (PUBLISH, RESERVED_0, RESERVED_15):
        return None
    required = amqtt_glue._FIXED_FLAGS.get(packet_type, 0)
    if flags == required:
        return None
    return ProtocolViolationError(f"packet type {packet_type} with fixed header flags {flags:#06b}")


def best_ns(statement: str, names: dict[str, Any]) -> float:
    return min(timeit.repeat(statement, globals=names, number=N, repeat=7)) / N * 1e9


def main() -> None:
    print("| packet | before (ns) | now (ns) |\n|---|---:|---:|")
    for name, (first, looked_up) in CASES.items():
        names = {"check": fixed_flags_problem, "first": first, "bad": amqtt_glue._BAD_FIRST}
        base = best_ns("first", names)
        before = best_ns("check(first >> 4, first & 0x0F)", names) - base
        now = f"{best_ns('bad[first]', names) - base:.1f}" if looked_up else "0 (not looked up)"
        print(f"| {name} | {before:.1f} | {now} |")


if __name__ == "__main__":
    main()
