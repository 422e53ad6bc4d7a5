"""``durable-pipeline``: the pipeline's console entry, one subcommand per job.

    durable-pipeline audit INPUT... --out DIR --expect exactly-once|at-least-once
                           [--ignore-order] [--count-qos0] [--master local[2,4]]
    durable-pipeline demo [--out ./out] [--events 2000] [--devices 3] [--master local[2,4]]

Exit status: 0 the guarantee holds, 1 it does not, 2 the job could not run (bad input, no
Java, no pipeline extra): the message on stderr says what and what to do.

Adding a subcommand: write ``_add_NAME(subcommands)`` that adds its parser and sets
``run=`` to a function of the parsed arguments returning the exit status, and list it in
:data:`SUBCOMMANDS`. Import Spark inside ``run`` (``--help`` stays instant).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PipelineError, missing_extra
from .spark import DEFAULT_MASTER, check_master, check_out_folder

if TYPE_CHECKING:
    from .audit import AuditResult

EXIT_HOLDS = 0
EXIT_FAILS = 1
EXIT_ERROR = 2
MAX_ROWS_PRINTED = 50
"""Devices printed; the report and summary.parquet have all of them."""

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_audit(subcommands: Subcommands) -> None:
    parser = subcommands.add_parser(
        "audit",
        help="audit SDK delivery logs: every acknowledged send reached every durable subscriber, once, in order",
        description="Audit delivery logs (docs/delivery-log.md): JSON lines (*.jsonl) or Parquet files, or folders "
        "of them, on local paths or any Hadoop file system (hdfs://, s3a://). Writes DIR/summary.parquet and "
        "DIR/report.html (a local folder); exits 0 when the guarantee holds, 1 when it does not, 2 on bad input.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="delivery-log file or folder: a local path or a URI of a Hadoop file system Spark is configured for "
        "(hdfs://, s3a:// with the hadoop-aws package, file://)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="a local folder on the driver (this machine), made if missing: summary.parquet, report.html and the "
        "charts go there",
    )
    parser.add_argument(
        "--expect",
        required=True,
        choices=["exactly-once", "at-least-once"],
        help="exactly-once: nothing lost or duplicated; at-least-once: nothing lost",
    )
    parser.add_argument("--ignore-order", action="store_true", help="do not require per-publisher order")
    parser.add_argument(
        "--count-qos0",
        action="store_true",
        help="expect QoS 0 sends too, and let durable QoS 0 subscriptions expect like QoS 1 ones: shows what a run "
        "that published at QoS 0 through connection drops lost (non-durable subscriptions still expect nothing)",
    )
    parser.add_argument("--master", default=DEFAULT_MASTER, help=f"Spark master (default {DEFAULT_MASTER})")
    parser.set_defaults(run=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    from .audit import run_audit  # noqa: PLC0415 - pyspark loads only when a job runs
    from .logs import check_local_inputs  # noqa: PLC0415
    from .spark import job_session  # noqa: PLC0415

    check_master(args.master)  # a wrong master, local path, file or --out fails before a JVM starts
    check_local_inputs(args.inputs)
    check_out_folder(args.out)
    # main() called in a process that already runs a SparkSession, in any thread (a notebook, a test), audits with
    # that one (--master is then not used) and leaves it running with its settings and log level as they were:
    # only a session the job started is the job's to stop (or to set up: get_session).
    with job_session(args.master, "durable-pipeline audit") as spark:
        result = run_audit(
            spark, args.inputs, args.out, args.expect, check_order=not args.ignore_order, count_qos0=args.count_qos0
        )
    print(format_summary(result))
    return EXIT_HOLDS if result.ok else EXIT_FAILS


def format_summary(result: AuditResult) -> str:
    """The per-device table (ALL first), the notes, where the report is, and the verdict last."""
    from .report import HEADERS, cell  # noqa: PLC0415 - matplotlib loads only when a job runs

    rows = [[label for _, label in HEADERS]]
    for stats in [result.total, *result.devices[:MAX_ROWS_PRINTED]]:
        rows.append([cell(stats, name) for name, _ in HEADERS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = [
        "  ".join(
            value.ljust(width) if i == 0 else value.rjust(width)
            for i, (value, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    if len(result.devices) > MAX_ROWS_PRINTED:
        lines.append(f"... {len(result.devices) - MAX_ROWS_PRINTED} more devices in {result.summary_path}")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"{result.records} records; report: {result.report_path}")
    lines.append(("OK: " if result.ok else "FAILED: ") + result.verdict)
    return "\n".join(lines)


def _add_demo(subcommands: Subcommands) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="end to end: a broker, SDK devices and a publisher, the streaming query into OUT, the audit of the run",
        description="Starts a broker (127.0.0.1, a free port, a stream log on telemetry/#, store under OUT/store), "
        "SDK devices writing delivery logs (one is away for half the run, so it gets a replay) and a publisher; "
        "then the amqtt-durable streaming query into OUT/events (Parquet, checkpoint in OUT/checkpoint) and the "
        "exactly-once audit of OUT/logs into OUT/audit/report.html. Exit 0 when every event is in the Parquet "
        "output once and the audit holds.",
    )
    parser.add_argument("--out", default="./out", metavar="DIR", help="where everything goes (default ./out)")
    parser.add_argument("--events", type=int, default=2000, help="events to publish (default 2000)")
    parser.add_argument("--devices", type=int, default=3, help="SDK devices receiving them (default 3)")
    parser.add_argument("--master", default=DEFAULT_MASTER, help=f"Spark master (default {DEFAULT_MASTER})")
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo  # noqa: PLC0415 - pyspark loads only when a job runs

    if args.events < 2 or args.devices < 1:
        raise PipelineError("the demo needs --events 2 or more and --devices 1 or more")
    check_master(args.master)  # before the demo's broker and devices start
    check_out_folder(args.out)
    result = run_demo(Path(args.out), events=args.events, devices=args.devices, master=args.master)
    print(f"published {result.events_published} events; {result.events_in_parquet} in {args.out}/events (Parquet)")
    print(format_summary(result.audit))
    in_parquet = result.events_in_parquet == result.distinct_in_parquet == result.events_published
    if not in_parquet:
        print(
            f"FAILED: the streaming query wrote {result.events_in_parquet} rows, {result.distinct_in_parquet} distinct "
            f"(topic, id), for {result.events_published} events published"
        )
    return EXIT_HOLDS if result.audit.ok and in_parquet else EXIT_FAILS


SUBCOMMANDS: list[Callable[[Subcommands], None]] = [_add_audit, _add_demo]
"""Each adds one subcommand (a parser with ``run`` set)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="durable-pipeline", description="Spark jobs over amqtt-durable.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry: run the subcommand, turn the pipeline's errors into exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
    except PipelineError as exc:
        print(f"durable-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ModuleNotFoundError as exc:  # installed without the pipeline extra: say so, not a traceback
        if not missing_extra(exc):
            raise
        print(
            f"durable-pipeline {args.command}: error: the Spark jobs need the pipeline extra "
            f"(pip install 'amqtt-durable[pipeline]'): {exc}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return status


if __name__ == "__main__":
    sys.exit(main())
