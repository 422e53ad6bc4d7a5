"""``amqtt-durable``, the console command: the plugin's broker, inspect and repair, and the fleet run.

It lives here, above both, so the plugin imports nothing of the fleet harness (which imports the
plugin). ``fleet`` is loaded only when asked for: it needs the pipeline extra (Spark, matplotlib).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from amqtt_durable.cli import EXIT_BAD_INPUT, add_commands, exit_process, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amqtt-durable",
        description="run the broker with a checked config, inspect or repair a store, or test a fleet through faults",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_commands(commands)
    fleet = commands.add_parser(
        "fleet", add_help=False, help="fault-injection run of simulated devices, judged by the Spark audit (--help)"
    )
    fleet.add_argument("options", nargs=argparse.REMAINDER, help="see amqtt-durable fleet --help")
    return parser


def _fleet(argv: list[str]) -> int:
    from durable_pipeline.errors import PIPELINE_EXTRA, missing_extra  # noqa: PLC0415 - the broker loads no pipeline

    try:
        from durable_fleet.cli import main as fleet_main  # noqa: PLC0415 - Spark and matplotlib only here

        for module in PIPELINE_EXTRA:  # imported before the run, not found missing by the audit once it is over
            importlib.import_module(module)  # the Python packages only: no JVM starts
    except ModuleNotFoundError as exc:
        if not missing_extra(exc):  # another module missing is a fault: its traceback
            raise
        print(f"amqtt-durable fleet needs the pipeline extra (pip install 'amqtt-durable[pipeline]'): {exc}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return fleet_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fleet"]:  # its own parser (argparse's REMAINDER would not pass on --help)
        return _fleet(argv[1:])
    return run(build_parser().parse_args(argv))


def console_main() -> None:
    """The ``amqtt-durable`` entry point (``python -m durable_fleet.console`` too)."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
