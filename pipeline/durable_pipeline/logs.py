"""Reading delivery logs (docs/delivery-log.md, version 1) into one checked Spark DataFrame.

Inputs are local paths: JSON-lines files (``*.jsonl``, ``*.json``, ``*.ndjson``, optionally
``.gz``), Parquet files (``*.parquet``), or folders holding either (searched recursively; files
whose name starts with ``_`` or ``.`` are Spark's or Hadoop's bookkeeping and are skipped; a
file with another extension is recognised by its first bytes).

Nothing is dropped silently: a JSON line that is not a JSON object of the documented types, a
truncated Parquet file, a record without a column its kind needs and an unknown ``kind`` each
stop the audit with an :class:`AuditInputError` naming the file, because an audit that quietly
skips records can report "nothing lost" about records it never read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .errors import AuditInputError

Format = Literal["json", "parquet"]

# (column, Spark type), in the order of docs/delivery-log.md.
COLUMNS: tuple[tuple[str, DataType], ...] = (
    ("kind", StringType()),
    ("device", StringType()),
    ("time", DoubleType()),
    ("topic", StringType()),
    ("id", StringType()),
    ("qos", IntegerType()),
    ("replayed", BooleanType()),
    ("redelivered", BooleanType()),
    ("seq", LongType()),
    ("epoch", LongType()),
    ("published_at", DoubleType()),
    ("durable", BooleanType()),
    ("session_present", BooleanType()),
    ("replayed_count", LongType()),
)
KINDS = ("send", "receive", "subscribe", "unsubscribe", "session_end", "connect", "live")
REQUIRED_ALWAYS = ("kind", "device", "time")
"""Every record has these (and a Parquet file must have the columns)."""
REQUIRED_BY_KIND: dict[str, tuple[str, ...]] = {
    "send": ("topic", "id"),
    "receive": ("topic", "id"),
    "subscribe": ("topic",),
    "unsubscribe": ("topic",),
}
"""What the audit cannot do without for a record of that kind; the other columns are optional."""

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".parq")
CORRUPT = "_corrupt_record"
FILE = "_file"
MAX_LISTED = 5
"""Problems listed per error message; the rest are counted."""


@dataclass(frozen=True)
class LogFiles:
    """The files found under the inputs, by format."""

    json: list[str]
    parquet: list[str]

    @property
    def count(self) -> int:
        return len(self.json) + len(self.parquet)


@dataclass(frozen=True)
class DeliveryLogs:
    """The checked records (persisted: the caller unpersists) and where they came from."""

    records: DataFrame
    files: LogFiles
    kinds: dict[str, int]
    """Records per kind (every kind, 0 when absent)."""

    @property
    def count(self) -> int:
        return sum(self.kinds.values())


def log_schema() -> StructType:
    """The documented columns with their Spark types (the explicit schema of every read)."""

    return StructType([StructField(name, data_type, nullable=True) for name, data_type in COLUMNS])


def find_files(inputs: Sequence[str]) -> LogFiles:
    """The log files named by ``inputs`` (files or folders), sorted, each format apart."""
    if not inputs:
        raise AuditInputError("no input given: name delivery-log files or folders (JSON lines or Parquet)")
    found: dict[Format, list[str]] = {"json": [], "parquet": []}
    for raw in inputs:
        path = Path(raw)
        if not path.exists():
            raise AuditInputError(f"input {raw} does not exist: give a delivery-log file or a folder of them")
        if path.is_dir():
            candidates = sorted(p for p in _walk(path))
            if not candidates:
                raise AuditInputError(f"folder {raw} holds no delivery-log files (*.jsonl, *.json, *.parquet)")
        else:
            candidates = [path]
        for file in candidates:
            found[_format_of(file)].append(str(file.resolve()))
    return LogFiles(json=sorted(set(found["json"])), parquet=sorted(set(found["parquet"])))


def _walk(folder: Path) -> Iterable[Path]:
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in names:
            if not name.startswith((".", "_")):
                yield Path(root, name)


def _format_of(file: Path) -> Format:
    """By extension, else by content: Parquet starts with ``PAR1``, a JSON line with ``{``."""
    name = file.name.lower().removesuffix(".gz")
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    with file.open("rb") as handle:
        head = handle.read(64)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.lstrip().startswith(b"{"):
        return "json"
    raise AuditInputError(
        f"{file} is neither JSON lines nor Parquet (by its extension and its first bytes): "
        "name delivery logs *.jsonl or *.parquet, or leave other files out of the input folders"
    )


def read_logs(spark: SparkSession, inputs: Sequence[str]) -> DeliveryLogs:
    """All records of ``inputs`` with the documented schema, checked, persisted.

    Raises AuditInputError for a missing path, no records, corrupt files or records, missing
    columns and unknown kinds.
    """

    files = find_files(inputs)
    parts: list[DataFrame] = []
    if files.json:
        parts.append(_read_json(spark, files.json))
    for group in _parquet_groups(files.parquet):
        parts.append(_read_parquet(spark, group))
    frame = parts[0]
    for part in parts[1:]:
        frame = frame.unionByName(part)
    frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        kinds = _check(frame)
    except AuditInputError:
        frame.unpersist()
        raise
    except Exception as exc:
        frame.unpersist()
        unreadable = _unreadable_file(str(exc))
        if unreadable:  # a broken .gz, a Parquet data page damaged behind a sound footer
            raise AuditInputError(unreadable) from exc
        raise
    return DeliveryLogs(records=frame.drop(CORRUPT, FILE), files=files, kinds=kinds)


def _unreadable_file(error: str) -> str | None:
    """The message for Spark's FAILED_READ_FILE error (the file, the cause), or None for another error.

    Spark's error text starts with the Py4J call (``An error occurred while calling o326...``),
    which tells a reader nothing; the file is in the FAILED_READ_FILE line, the reason in the
    first ``Caused by:`` line of the Java trace.
    """
    line = next((text for text in error.splitlines() if "FAILED_READ_FILE" in text), None)
    if line is None:
        return None
    found = _FAILED_READ.search(line)
    cause = _CAUSE.search(error)
    why = f" ({cause.group(1).strip()})" if cause else ""
    if found is None:
        return f"a delivery-log file cannot be read{why}: {line.strip()}"
    path = found.group("path")
    if path.startswith("file:"):
        path = unquote(urlparse(path).path)
    return (
        f"{path} cannot be read{why}: it may be truncated, still being written or not what its name says "
        "(a .gz that is not gzip); rewrite it or leave it out"
    )


_FAILED_READ = re.compile(r"reading file (?P<path>.+?)\.?(?:\s+SQLSTATE|\s*$)")
"""Spark 4: ``[FAILED_READ_FILE.NO_HINT] Encountered error while reading file file:///x.jsonl.gz.  SQLSTATE: KD001``"""
_CAUSE = re.compile(r"Caused by: ([^\n]+)")


def _read_json(spark: SparkSession, paths: list[str]) -> DataFrame:
    """PERMISSIVE with a corrupt-record column, so bad lines are counted (and reported), not lost."""

    schema = log_schema().add(CORRUPT, StringType(), nullable=True)
    frame = (
        spark.read.schema(schema).option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", CORRUPT).json(paths)
    )
    return frame.select(*[name for name, _ in COLUMNS], sf.col("_metadata.file_path").alias(FILE), CORRUPT)


def _parquet_groups(paths: list[str]) -> list[list[str]]:
    """Parquet files grouped by schema, each checked: readable, with the required columns.

    Reading the footers here (metadata only) names a truncated file plainly, and lets files
    written with other column types (``time`` as int64, ``qos`` as int64) be read and cast.
    """

    groups: dict[str, list[str]] = {}
    for path in paths:
        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for bad files
            raise AuditInputError(
                f"{path} is not a readable Parquet file ({exc}): it may be truncated or still being written; "
                "rewrite it or leave it out"
            ) from exc
        missing = [name for name in REQUIRED_ALWAYS if name not in schema.names]
        if missing:
            raise AuditInputError(
                f"{path} lacks the required column(s) {', '.join(missing)} (docs/delivery-log.md): "
                f"it has {', '.join(schema.names) or 'no columns'}"
            )
        for name, data_type in COLUMNS:
            if name in schema.names and not _convertible(schema.field(name).type, data_type):
                raise AuditInputError(
                    f"column {name} of {path} is {schema.field(name).type}, which does not convert to "
                    f"{data_type.simpleString()} (docs/delivery-log.md): rewrite the file with that type"
                )
        groups.setdefault(str(schema.remove_metadata()), []).append(path)
    return list(groups.values())


def _convertible(have: pa.DataType, want: DataType) -> bool:
    """Whether a Parquet column's type casts to the documented one without losing its meaning."""
    if pa.types.is_null(have):
        return True
    if isinstance(want, StringType):
        return bool(pa.types.is_string(have) or pa.types.is_large_string(have))
    if isinstance(want, BooleanType):
        return bool(pa.types.is_boolean(have))
    if isinstance(want, DoubleType):
        return bool(pa.types.is_floating(have) or pa.types.is_integer(have) or pa.types.is_decimal(have))
    return bool(pa.types.is_integer(have))


def _read_parquet(spark: SparkSession, paths: list[str]) -> DataFrame:
    """Files of one schema, each documented column cast to its type (missing optional ones null)."""

    frame = spark.read.parquet(*paths)
    present = set(frame.columns)
    schema = log_schema()
    columns: list[Column] = []
    for field in schema.fields:
        if field.name in present:
            columns.append(_cast(sf.col(field.name), frame.schema[field.name].dataType, field.dataType, field.name))
        else:
            columns.append(sf.lit(None).cast(field.dataType).alias(field.name))
    return frame.select(
        *columns, sf.col("_metadata.file_path").alias(FILE), sf.lit(None).cast(StringType()).alias(CORRUPT)
    )


def _cast(column: Column, have: DataType, want: DataType, name: str) -> Column:
    """try_cast: a value that does not convert becomes null and is then reported as missing."""
    if have == want:
        return column.alias(name)
    return column.try_cast(want).alias(name)


def _check(frame: DataFrame) -> dict[str, int]:
    """One aggregation per file over every rule; raises for the first kind of problem found.

    Returns the number of records per kind.
    """

    good = sf.col(CORRUPT).isNull()
    known = sf.col("kind").isin(*KINDS)
    aggs: list[Column] = [
        sf.count(sf.lit(1)).alias("records"),
        sf.sum(sf.when(~good, 1).otherwise(0)).alias("corrupt"),
        sf.first(CORRUPT, ignorenulls=True).alias("corrupt_example"),
        sf.sum(sf.when(good & sf.col("kind").isNotNull() & ~known, 1).otherwise(0)).alias("unknown_kind"),
        sf.first(sf.when(good & ~known, sf.col("kind")), ignorenulls=True).alias("unknown_example"),
    ]
    aggs += [sf.sum(sf.when(good & (sf.col("kind") == kind), 1).otherwise(0)).alias(f"kind__{kind}") for kind in KINDS]
    missing_names: list[tuple[str, str]] = []
    for name in REQUIRED_ALWAYS:
        alias = f"missing__{name}"
        aggs.append(sf.sum(sf.when(good & sf.col(name).isNull(), 1).otherwise(0)).alias(alias))
        missing_names.append((alias, f"{name} (in any record)"))
    for kind, names in REQUIRED_BY_KIND.items():
        for name in names:
            alias = f"missing__{kind}__{name}"
            aggs.append(
                sf.sum(sf.when(good & (sf.col("kind") == kind) & sf.col(name).isNull(), 1).otherwise(0)).alias(alias)
            )
            missing_names.append((alias, f"{name} (in {kind} records)"))
    per_file = frame.groupBy(FILE).agg(*aggs).collect()  # one row per input file: small
    total = sum(int(row["records"]) for row in per_file)
    if total == 0:
        raise AuditInputError(
            "the inputs hold no records: check that the delivery logs were written (delivery_log=PATH)"
        )
    _raise_corrupt([row for row in per_file if row["corrupt"]])
    _raise_missing(per_file, missing_names)
    _raise_unknown_kind([row for row in per_file if row["unknown_kind"]])
    return {kind: sum(int(row[f"kind__{kind}"]) for row in per_file) for kind in KINDS}


def _file_name(path: str) -> str:
    return path.removeprefix("file://").removeprefix("file:")


def _raise_corrupt(rows: list[Row]) -> None:
    if not rows:
        return
    lines = [
        f"{_file_name(row[FILE])}: {row['corrupt']} of {row['records']} lines, "
        f"e.g. {_clip(row['corrupt_example'])!r}"
        for row in rows[:MAX_LISTED]
    ]
    more = f" (and {len(rows) - MAX_LISTED} more files)" if len(rows) > MAX_LISTED else ""
    raise AuditInputError(
        "lines that are not JSON objects of the documented types (docs/delivery-log.md) in "
        + "; ".join(lines)
        + more
        + ": the audit does not skip records; fix or remove those lines "
        "(a line cut short by a crash is the last of its file)"
    )


def _raise_missing(rows: list[Row], names: list[tuple[str, str]]) -> None:
    problems: list[str] = []
    for row in rows:
        gaps = [f"{label}: {row[alias]}" for alias, label in names if row[alias]]
        if gaps:
            problems.append(f"{_file_name(row[FILE])} ({', '.join(gaps)})")
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more files)" if len(problems) > MAX_LISTED else ""
        raise AuditInputError(
            "records without a required column, by file (column: records lacking it): "
            + "; ".join(problems[:MAX_LISTED])
            + more
            + ". Every record needs kind, device and time; send and receive need topic and id, subscribe and "
            "unsubscribe need topic"
        )


def _raise_unknown_kind(rows: list[Row]) -> None:
    if not rows:
        return
    lines = [
        f"{_file_name(row[FILE])}: {row['unknown_kind']} records, e.g. kind={row['unknown_example']!r}"
        for row in rows[:MAX_LISTED]
    ]
    raise AuditInputError(
        f"unknown kind values (known: {', '.join(KINDS)}) in " + "; ".join(lines) + ": these logs are not version 1 "
        "delivery logs, or were written by a newer SDK; fix the writer or leave these files out"
    )


def _clip(text: object, limit: int = 80) -> str:
    value = str(text)
    return value if len(value) <= limit else value[:limit] + "..."
