"""``amqtt-durable``: run the broker with a checked config, inspect or repair a store."""

# The console command is durable_fleet.console: it adds ``fleet`` to these commands, so the
# plugin knows nothing of the packages above it (no import cycle through the fleet harness).

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import re
import signal
import ssl
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, NoReturn

import yaml

from durable_protocol import int_digits, too_many_digits

from .config import DurableConfig
from .errors import BrokerNotStartedError, ConfigError, DurableError
from .inspect_store import format_retained, format_table, summarize, summarize_retained
from .repair import repair
from .replication.config import SECRET_KEYS, read_secret_file
from .replication.errors import ReplicationError
from .replication.framing import Frame
from .replication.tool import ask, promote_answer, split_address, status_text
from .settings import TooLargeFloat

log = logging.getLogger("amqtt_durable")

PLUGIN_PATH = "amqtt_durable.DurableSessionsPlugin"
EXIT_BAD_INPUT = 2
PLUGIN_ITEM_EXPECTED = "expected a plugin name or a mapping of a plugin to its settings"
GC_THRESHOLD = 100_000
FAILED_START_SHUTDOWN_TIMEOUT = 10.0
"""Seconds the shutdown after a failed start may take; past them the process exits 1 without it."""


def plugin_entries(config: Mapping[str, Any]) -> dict[str, Any]:
    """broker.yaml's ``plugins:`` as one mapping (amqtt accepts a mapping or a list)."""
    return _plugins(config)[0]


def _plugins(config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``plugin_entries`` and our plugin's key as errors name any key that is not one of its settings, by its
    path from the top of the file: ``plugins.<plugin>``, or ``plugins[N].<plugin>`` for the item of a
    ``plugins:`` list that holds it."""
    plugins = config.get("plugins")
    entries: dict[str, Any] = dict(plugins) if isinstance(plugins, Mapping) else {}
    key_path = f"plugins.{PLUGIN_PATH}"
    if isinstance(plugins, list):
        for index, item in enumerate(plugins):
            if not isinstance(item, str | Mapping):  # amqtt refuses it too, with a traceback
                raise ConfigError(f"plugins[{index}]", PLUGIN_ITEM_EXPECTED)
            item_entries = {item: None} if isinstance(item, str) else item
            if PLUGIN_PATH in item_entries:
                key_path = f"plugins[{index}].{PLUGIN_PATH}"
                if PLUGIN_PATH in entries:  # the later one would win unseen
                    raise ConfigError(key_path, "given twice in 'plugins'; list it once")
            entries.update(item_entries)
    return entries, key_path


def plugin_section(config: Mapping[str, Any]) -> Any:
    """Our plugin's settings from broker.yaml: None when it is not loaded, {} when it is given no settings
    (``null``, or a bare name in a ``plugins:`` list); anything else as written, checked by the caller."""
    return _settings(plugin_entries(config))


def _settings(entries: Mapping[str, Any]) -> Any:
    if PLUGIN_PATH not in entries:
        return None
    return {} if entries[PLUGIN_PATH] is None else entries[PLUGIN_PATH]


YAML_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UnreadableValueError(ValueError):
    """A scalar PyYAML cannot turn into its value (an int of 4,301 digits or more, a 13th month), with its line."""

    def __init__(self, node: yaml.Node, reason: object) -> None:
        self.line = node.start_mark.line + 1
        self.reason = str(reason)
        super().__init__(f"line {self.line}: {self.reason}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last one
    silently, so a second ``store:`` would win unseen)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.paths: dict[int, str] = {}
        """Each mapping's place in the file, as its keys are named in errors (see ``_name``)."""
        self.checked: set[int] = set()
        """The mappings whose keys were checked (a merged one may be merged again, or merge itself)."""

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        node.written = list(node.value)  # type: ignore[attr-defined]  # merging another mapping rewrites .value
        return node

    def construct_document(self, node: yaml.Node) -> Any:
        self.paths.clear()
        self.checked.clear()
        self._name_mappings(node, "", set())
        return super().construct_document(node)

    def _name_mappings(self, node: yaml.Node, path: str, walked: set[int]) -> None:
        """Name the mappings in ``node`` and below; each list or mapping once, where it was written
        (an alias is walked no further: `x: &s [*s]` holds itself, 10 aliases of 10 aliases ...)."""
        if not isinstance(node, yaml.SequenceNode | yaml.MappingNode) or id(node) in walked:
            return
        walked.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._name_mappings(item, f"{path}[{index}]", walked)
        else:
            self.paths[id(node)] = path
            for key_node, value_node in getattr(node, "written", None) or node.value:
                if key_node.tag == YAML_MERGE_TAG:  # `<<: {...}`, `<<: [{...}]`: named `a.<<`, `a.<<[0]`
                    self._name_mappings(value_node, f"{path}.<<" if path else "<<", walked)
                elif isinstance(key_node, yaml.ScalarNode):
                    self._name_mappings(value_node, _key_path(path, key_node.value), walked)

    def _name(self, node: yaml.MappingNode, key: Any) -> str:
        path = self.paths.get(id(node), "")
        if _is_plugin_key(path, str(key)):  # the plugin's key itself, not a setting inside it
            return f"{path}.{key}"
        return _key_path(path, str(key))

    def construct_printable_int(self, node: yaml.ScalarNode) -> int:
        """An int as PyYAML reads it, refused past ``int_digits()`` decimal digits (a hexadecimal one may
        have them), so every error that shows a value can print it (it crashed with a traceback, exit 1);
        a decimal one's digits are counted before they are converted (Python's own message named a
        setting of Python, or took time quadratic in them where its limit is off)."""
        written = str(node.value).replace("_", "").lstrip("+-")
        decimal = not written.startswith("0")  # 0x, 0b and 0-octal convert in linear time, unlimited
        if decimal and any(len(part) > int_digits() for part in written.split(":")):  # 1:30 is base 60
            raise ValueError(f"an integer of more than {int_digits()} digits")
        value: int = self.construct_yaml_int(node)
        if too_many_digits(value):
            raise ValueError(f"an integer of more than {int_digits()} digits")
        return value

    def construct_finite_float(self, node: yaml.ScalarNode) -> float:
        """A float as PyYAML reads it, but one written finite that no float holds (``1.0e+400``: PyYAML
        reads inf) kept as a ``TooLargeFloat``, which a setting refuses as too large for a float."""
        value: float = self.construct_yaml_float(node)
        if math.isinf(value) and "inf" not in str(node.value).lower():
            return TooLargeFloat.written(value, str(node.value))
        return value

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, its ValueError given the line of the scalar it could not read (an item of a list
        or a key has no key name to show)."""
        try:
            return super().construct_object(node, deep=deep)
        except _UnreadableValueError:
            raise
        except ValueError as exc:  # PyYAML's int() or date() of a scalar
            raise _UnreadableValueError(node, exc) from exc

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self._refuse_repeated_keys(node, deep)
        return super().construct_mapping(node, deep=deep)

    def _refuse_repeated_keys(self, node: yaml.MappingNode, deep: bool) -> None:
        """A key given twice in ``node``, or in a mapping it merges (PyYAML reads a merged mapping's
        pairs itself, never through construct_mapping), is a ConfigError naming it."""
        if id(node) in self.checked:
            return
        self.checked.add(id(node))
        lines: dict[Any, int] = {}
        pairs: list[tuple[Any, Any]] = getattr(node, "written", None) or node.value or []
        for key_node, value_node in pairs:
            if key_node.tag == YAML_MERGE_TAG:  # a key of its own may override a merged one (YAML merge keys)
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for mapping in merged:
                    if isinstance(mapping, yaml.MappingNode):
                        self._refuse_repeated_keys(mapping, deep)
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # a complex key (`? [1, 2]`): the parent's ConstructorError names it
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(
                    self._name(node, key), f"given twice in one mapping (lines {lines[key]} and {line}); say it once"
                )
            lines[key] = line
            try:  # built once here (the loader keeps it for the mapping below), so its error names the key
                self.construct_object(value_node, deep=deep)
            except _UnreadableValueError as exc:  # 4,301 digits or more, a 13th month: named by its key, at its line
                reason = f"line {exc.line}: a value YAML cannot read: {exc.reason}"
                raise ConfigError(self._name(node, key), reason) from exc


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_printable_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_finite_float)


def _key_path(path: str, key: str) -> str:
    """A key as errors name it: the plugin's own as its settings are named (``store``,
    ``replication.mode``, ``streams[0].max_count``), any other by its path from the top of the file
    (``listeners.default.bind``)."""
    if _is_plugin_key(path, key):
        return ""
    return f"{path}.{key}" if path else key


def _is_plugin_key(path: str, key: str) -> bool:
    """``key`` at ``path`` loads our plugin (amqtt takes ``plugins:`` as a mapping or a list)."""
    return key == PLUGIN_PATH and re.fullmatch(r"plugins(\[\d+\])?", path) is not None


def load_broker_config(path: str) -> dict[str, Any]:
    """Read broker.yaml and validate our section before amqtt sees it."""
    config = read_broker_yaml(path)
    DurableConfig.from_mapping(_our_section(config, path))
    return config


def _our_section(config: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    entries, key_path = _plugins(config)
    section = _settings(entries)
    if section is None:
        raise ConfigError("plugins", f"'{path}' does not load {PLUGIN_PATH}; add it under 'plugins:'")
    if not isinstance(section, Mapping):
        raise ConfigError(key_path, "expected a mapping of settings")
    return section


def read_broker_yaml(path: str, option: str = "-c") -> dict[str, Any]:
    """broker.yaml as a mapping, our section not validated yet; its problems name ``option``, the
    command line's option that gave ``path`` (the broker's ``-c``, the tools' ``--config``)."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.load(handle, Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise ConfigError(option, f"cannot read config file '{path}': {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(option, f"'{path}' is not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(option, f"'{path}' is not valid YAML (not UTF-8): {exc}") from exc
    except RecursionError as exc:  # PyYAML's composer recurses once per level: 3,000 `[`
        raise ConfigError(option, f"'{path}' is not valid YAML: nested too deeply") from exc
    except _UnreadableValueError as exc:  # one construct_mapping does not name: an item of a list, a key itself
        raise ConfigError(option, f"'{path}' line {exc.line}: a value YAML cannot read: {exc.reason}") from exc
    if not isinstance(config, dict):
        raise ConfigError(option, f"'{path}' must be a mapping with 'listeners' and 'plugins'")
    return config


async def _stop_when_orphaned(parent: int, stop: asyncio.Event) -> None:
    """For a broker a tool started (--parent-pid): a tool killed without cleaning up leaves no broker."""
    while os.getppid() == parent:  # noqa: ASYNC110 - a parent's death has no event to wait on
        await asyncio.sleep(1.0)
    stop.set()


async def _shutdown_after_failed_start(broker_shutdown: Coroutine[Any, Any, None], failure: str) -> None:
    """Run the broker's shutdown, then print why it did not start: the last line, whatever the shutdown
    did (its error is logged). A shutdown still running after ``FAILED_START_SHUTDOWN_TIMEOUT`` is
    logged and left: the process exits 1 at once, since returning would let ``asyncio.run`` wait
    for it (its task, or a thread it waits on, at the executor's shutdown)."""
    shutdown = asyncio.ensure_future(broker_shutdown)
    done, _ = await asyncio.wait({shutdown}, timeout=FAILED_START_SHUTDOWN_TIMEOUT)
    if not done:
        log.error(
            "shutdown after a failed start did not end within %g s (FAILED_START_SHUTDOWN_TIMEOUT): exiting without it",
            FAILED_START_SHUTDOWN_TIMEOUT,
        )
    else:
        try:
            shutdown.result()
        except (Exception, asyncio.CancelledError):  # logged; the reason stays the last line
            log.exception("shutdown after a failed start failed")
    print(f"amqtt-durable: broker not started: {failure}", file=sys.stderr)
    if not done:
        exit_process(1)


async def _serve(config: dict[str, Any], parent: int | None = None) -> int:
    # amqtt loads here, not at import: inspect, repair and promote start without it (0.3 s of 0.6).
    from .amqtt_glue import start_broker, start_failure  # noqa: PLC0415

    try:
        broker = await start_broker(config)
    except BrokerNotStartedError as exc:
        print(f"amqtt-durable: broker not started: {exc}", file=sys.stderr)
        return 1
    failure = start_failure(broker)
    if failure is not None:
        await _shutdown_after_failed_start(broker.shutdown(), failure)
        return 1
    # Every message allocates a handful of short-lived objects; with CPython's default threshold
    # the collector runs every 700 allocations and costs ~10% of the message rate. Objects that
    # live as long as the broker are frozen out of its scans.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    watch = asyncio.create_task(_stop_when_orphaned(parent, stop)) if parent is not None else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await broker.shutdown()
    return 0


def _cmd_broker(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("transitions").setLevel(logging.WARNING)
    try:
        config = load_broker_config(args.config)
    except ConfigError as exc:
        print(f"amqtt-durable: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return asyncio.run(_serve(config, args.parent_pid))


def _cmd_inspect(args: argparse.Namespace) -> int:
    if (args.store is None) == (args.replication is None):  # argparse's usage error: exit code 2
        args.usage("give a store folder (broker stopped) or --replication HOST:PORT (broker running), one of them")
    if args.replication is not None and args.retained:
        args.usage("--retained lists a stopped broker's store, not --replication")
    for option, given in (("--config", args.config), ("--secret-file", args.secret_file)):
        if args.replication is None and given is not None:  # it would be ignored: a store is read without them
            args.usage(f"{option} is used with --replication only: a store folder is inspected without it")
    if args.replication is not None:
        status = asyncio.run(ask(args.replication, Frame.STATUS, *tool_credentials(args)))
        print(json.dumps(status, indent=2) if args.json else status_text(args.replication, status))
        return 0
    if args.retained:
        retained = summarize_retained(args.store)
        print(json.dumps([row.as_json() for row in retained], indent=2) if args.json else format_retained(retained))
        return 0
    rows = summarize(args.store)
    if args.json:
        print(json.dumps([row.as_json() for row in rows], indent=2))
    else:
        print(format_table(rows))
    return 0


def tool_credentials(args: argparse.Namespace) -> tuple[bytes | None, ssl.SSLContext | None]:
    """The replication secret and TLS context a tool connects with: the replication section of
    ``--config`` (secret, secret_file or secret_env, the variable read from this process's
    environment; tls), and ``--secret-file``, which wins for the secret: given, the config's
    secret, secret_file and secret_env are neither read nor checked (its variable need not be set
    here, nor its file readable)."""
    secret: bytes | None = None
    tls: ssl.SSLContext | None = None
    if args.config is not None:
        section = _our_section(read_broker_yaml(args.config, "--config"), args.config)
        replication = section.get("replication")
        if args.secret_file is not None and isinstance(replication, Mapping):
            kept = {key: value for key, value in replication.items() if key not in SECRET_KEYS}
            section = {**section, "replication": kept}
        settings = DurableConfig.from_mapping(section).replication
        if settings is None:
            raise ConfigError("--config", f"'{args.config}' has no replication section in the plugin's settings")
        secret = settings.shared_secret()
        tls = settings.tls.context(server=False) if settings.tls is not None else None
    if args.secret_file is not None:
        secret = read_secret_file(args.secret_file, "--secret-file")
    return secret, tls


def _replication_address(text: str) -> str:
    """argparse's check of a tool's HOST:PORT: a malformed one is a usage error (exit 2)."""
    try:
        split_address(text)
    except ReplicationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_secret_options(parser: argparse.ArgumentParser, note: str = "") -> None:
    """--config and --secret-file, their help ending with ``note`` (inspect's: with --replication only)."""
    parser.add_argument(
        "--config",
        metavar="BROKER_YAML",
        help="connect with the replication settings of this broker.yaml: its secret (replication.secret, "
        "secret_file or secret_env, read from this environment) and its TLS certificates (replication.tls)" + note,
    )
    parser.add_argument(
        "--secret-file", metavar="PATH", help="authenticate with the replication secret held in this file" + note
    )


def _cmd_promote(args: argparse.Namespace) -> int:
    answer = asyncio.run(ask(args.address, Frame.PROMOTE, *tool_credentials(args)))
    promoted, why = promote_answer(args.address, answer)
    if not promoted:
        print(f"amqtt-durable: {args.address} not promoted: {why}", file=sys.stderr)
        return 1
    print(f"{args.address}: {why}; it serves clients as the primary once its store is loaded")
    return 0


def _cmd_repair(args: argparse.Namespace) -> int:
    report = repair(args.store)
    print(f"repaired '{args.store}'; start the broker to use it")
    for line in report.rebuilt:
        print(f"  rebuilt: {line}")
    for line in report.lost:
        print(f"  not recovered: {line}")
    if not report.rebuilt and not report.lost:
        print("  session records, queue totals and message references were all consistent")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The plugin's commands; the console command (durable_fleet.console) adds ``fleet`` beside them."""
    broker = commands.add_parser("broker", help="run amqtt with broker.yaml (config checked first)")
    broker.add_argument("-c", "--config", default="broker.yaml", help="broker config file (default broker.yaml)")
    broker.add_argument("-d", "--debug", action="store_true", help="debug logging")
    broker.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # stop when that process is gone
    broker.set_defaults(run=_cmd_broker)
    inspect = commands.add_parser(
        "inspect", help="list the durable sessions of a store (broker stopped), or a running broker's replication"
    )
    inspect.add_argument("store", nargs="?", help="store folder (the plugin's 'store' setting)")
    inspect.add_argument(
        "--replication",
        metavar="HOST:PORT",
        type=_replication_address,
        help="show role, backups and lag of the broker replicating there",
    )
    _add_secret_options(inspect, " (with --replication only)")
    inspect.add_argument("--json", action="store_true", help="JSON instead of a table")
    inspect.add_argument("--retained", action="store_true", help="list the retained messages instead of the sessions")
    inspect.set_defaults(run=_cmd_inspect, usage=inspect.error)
    promote = commands.add_parser(
        "promote",
        help="make a backup the primary (the operator's decision); with a coordinator, only while no primary "
        "holds the lease",
    )
    promote.add_argument(
        "address", metavar="HOST:PORT", type=_replication_address, help="the backup's replication.listen address"
    )
    _add_secret_options(promote)
    promote.set_defaults(run=_cmd_promote)
    repairs = commands.add_parser(
        "repair", help="repair a damaged store: LevelDB's repair, then sessions and totals rebuilt (broker stopped)"
    )
    repairs.add_argument("store", help="store folder")
    repairs.set_defaults(run=_cmd_repair)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amqtt-durable", description=__doc__)
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a command ``add_commands`` parsed; a DurableError is one line on stderr and exit status 1."""
    try:
        code: int = args.run(args)
    except DurableError as exc:
        print(f"amqtt-durable: {exc}", file=sys.stderr)
        return 1
    return code


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


def exit_process(code: int) -> NoReturn:
    """Exit with ``code`` at once, skipping interpreter teardown (which avoids a spurious 'Error in
    sys.excepthook' CPython prints when plyvel was loaded next to amqtt). Called once a command has
    returned (its store closed by then), and by ``_shutdown_after_failed_start`` when the broker's
    shutdown did not end within ``FAILED_START_SHUTDOWN_TIMEOUT``: that shutdown is left unfinished,
    so the store may still be open."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def console_main() -> None:
    """``python -m amqtt_durable.cli``: broker, inspect and repair (the tests and tools start the broker so)."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
