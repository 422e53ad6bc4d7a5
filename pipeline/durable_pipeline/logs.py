"""Reading delivery logs (docs/delivery-log.md, version 1) into one checked Spark DataFrame.

Inputs are local paths or URIs of any Hadoop file system Spark is configured for (``hdfs://``,
``s3a://`` with the hadoop-aws package, ``file://``): JSON-lines files (``*.jsonl``, ``*.json``,
``*.ndjson``, optionally ``.gz``), Parquet files (``*.parquet``), or folders holding either
(searched recursively; files whose name starts with ``_`` or ``.``, or under such a folder, are
Spark's or Hadoop's bookkeeping and are skipped; a file with another extension is recognised by
its first bytes, decompressed when it is gzip named ``*.gz``: :func:`_sniff`). Listing, sniffing
and Parquet schemas all go through Spark's JVM (Hadoop's FileSystem API, ``spark.read.parquet``),
so a cluster needs nothing but a different master.

Nothing is dropped silently: a JSON line that is not a JSON object of the documented types, a
truncated Parquet file, a record without a column its kind needs and an unknown ``kind`` each
stop the audit with an :class:`AuditInputError` naming the file, because an audit that quietly
skips records can report "nothing lost" about records it never read.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]  # pyspark's own dependency, no stubs
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    NullType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from .errors import AuditInputError
from .spark import URI

log = logging.getLogger("durable_pipeline.logs")
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
CACHE_LEVEL = StorageLevel.DISK_ONLY
"""How the audit keeps the records (and its own intermediate frames) between jobs: written to the
executors' local disk and read back a batch at a time. MEMORY_AND_DISK keeps a whole partition as
one block, unrolled in the heap and read back whole from disk: 10M records in 3 input partitions
did not fit Spark's default 1 GB heap (bench/RESULTS.md); on disk, the heap holds only batches."""
SCHEMA_READERS = 8
"""Parquet schemas read at once: each is a small Spark job, mostly waiting on the driver."""
_URI = URI
"""An input that names a file system (``hdfs://nn/x``, ``file:/x``); anything else is a local path."""


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
    """The checked records and where they came from; the caller releases ``cached`` (:func:`unpersist`)."""

    cached: DataFrame
    """The persisted frame, with the read's file and corrupt-record columns: the one to unpersist
    (unpersisting ``records``, a projection of it, would leave it cached)."""
    files: LogFiles
    kinds: dict[str, int]
    """Records per kind (every kind, 0 when absent)."""

    @property
    def records(self) -> DataFrame:
        return self.cached.drop(CORRUPT, FILE)

    @property
    def count(self) -> int:
        return sum(self.kinds.values())


def unpersist(frames: Sequence[DataFrame]) -> None:
    """Unpersist ``frames`` in cleanup code, never raising: when a job failed because the SparkContext
    died (an OutOfMemoryError stops it), unpersist fails too (a NullPointerException), and raising
    that from a ``finally`` would hide the error that matters. Logged instead."""
    for frame in frames:
        try:
            frame.unpersist()
        except Exception:  # whatever it is: the caller's own error (if any) must get through
            log.warning("could not unpersist a cached frame (is the SparkContext stopped?)", exc_info=True)


def log_schema() -> StructType:
    """The documented columns with their Spark types (the explicit schema of every read)."""

    return StructType([StructField(name, data_type, nullable=True) for name, data_type in COLUMNS])


def check_local_inputs(inputs: Sequence[str]) -> None:
    """The inputs that are local paths exist, and those that are files are JSON lines or Parquet: the CLI's
    check, so a wrong path or file fails before a JVM starts (the files in a folder are checked in the JVM,
    by :func:`find_files`, which skips bookkeeping files as Spark does)."""
    for raw in inputs:
        if _URI.match(raw):
            continue
        if not os.path.exists(raw):
            raise _missing(raw)
        if os.path.isfile(raw):
            _check_format(os.path.abspath(raw), functools.partial(_local_head, raw))


def _missing(raw: str) -> AuditInputError:
    return AuditInputError(f"input {raw} does not exist: give a delivery-log file or a folder of them")


def find_files(spark: SparkSession, inputs: Sequence[str]) -> LogFiles:
    """The log files named by ``inputs`` (files or folders, local or Hadoop URIs), sorted, each format apart.

    Listed with Hadoop's FileSystem API in the driver's JVM: the same code reads a local folder,
    ``hdfs://`` or ``s3a://``. The paths returned are qualified (``file:/x``, ``hdfs://nn/x``).
    """
    if not inputs:
        raise AuditInputError("no input given: name delivery-log files or folders (JSON lines or Parquet)")
    found: dict[Format, list[str]] = {"json": [], "parquet": []}
    for raw in inputs:
        fs, status = _stat(spark, raw)
        if status.isDirectory():
            candidates = sorted(_walk(fs, status.getPath()))
            if not candidates:
                raise AuditInputError(f"folder {raw} holds no delivery-log files (*.jsonl, *.json, *.parquet)")
        else:
            candidates = [status.getPath().toString()]
        for file in candidates:
            found[_format_of(spark, fs, file)].append(file)
    return LogFiles(json=sorted(set(found["json"])), parquet=sorted(set(found["parquet"])))


def _stat(spark: SparkSession, raw: str) -> tuple[Any, Any]:
    """(Hadoop FileSystem, FileStatus) of one input; AuditInputError for an unknown scheme or a missing path."""
    jvm: Any = spark._jvm
    uri = _URI.match(raw)
    path = jvm.org.apache.hadoop.fs.Path(raw if uri else os.path.abspath(raw))  # relative to this process's cwd
    try:
        fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    except Py4JJavaError as exc:
        scheme = uri.group("scheme") if uri else "file"
        raise AuditInputError(
            f"input {raw}: Spark has no file system for its scheme {scheme}:// ({_java_reason(exc)}): give a local "
            "path or a URI of a file system Spark is configured for (hdfs://, file://, s3a:// with the hadoop-aws "
            "package and its settings)"
        ) from exc
    try:
        return fs, fs.getFileStatus(path)
    except Py4JJavaError as exc:
        if jvm.java.lang.Class.forName("java.io.FileNotFoundException").isInstance(exc.java_exception):
            raise _missing(raw) from exc
        raise AuditInputError(f"input {raw} cannot be read ({_java_reason(exc)})") from exc


def _java_reason(exc: Py4JJavaError) -> str:
    """The innermost Java cause, ``Class: message``: what went wrong without the Py4J call or the trace."""
    cause = exc.java_exception
    while cause.getCause() is not None:
        cause = cause.getCause()
    return f"{cause.getClass().getSimpleName()}: {cause.getMessage()}"


def _walk(fs: Any, folder: Any) -> Iterator[str]:
    """Every file under ``folder``, except bookkeeping: a name, or a folder on the way, starting with . or _."""
    root = folder.toString().rstrip("/") + "/"
    files = fs.listFiles(folder, True)
    while files.hasNext():
        path = files.next().getPath().toString()
        if not any(part.startswith((".", "_")) for part in path.removeprefix(root).split("/")):
            yield path


def _format_of(spark: SparkSession, fs: Any, file: str) -> Format:
    """By extension, else by content: Parquet starts with ``PAR1``, a JSON line with ``{`` (see :func:`_sniff`)."""
    return _check_format(file, lambda: _head(spark, fs, file))


def _check_format(file: str, head_of: Callable[[], bytes]) -> Format:
    """:func:`_format_of` given how to read the file's first bytes (``head_of``, called only without a known
    extension): in the JVM through Hadoop, or a local file before any JVM starts (:func:`check_local_inputs`)."""
    name = file.rsplit("/", 1)[-1].lower()
    gzipped = name.endswith(".gz")
    name = name.removesuffix(".gz")
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    found = _sniff(head_of(), gzipped=gzipped)
    if found is None:
        raise AuditInputError(
            f"{_file_name(file)} is neither JSON lines nor Parquet (by its extension and its first bytes): "
            "name delivery logs *.jsonl or *.parquet, or leave other files out of the input folders"
        )
    return found


HEAD_BYTES = 64 * 1024
"""How much of a file without a known extension is read to tell its format (room for blank lines first)."""
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"


def _sniff(head: bytes, *, gzipped: bool) -> Format | None:
    """The format of a file that starts with ``head`` (its first :data:`HEAD_BYTES`), None when neither.

    A file named ``*.gz`` that holds gzip is judged by its decompressed start, as Spark (Hadoop's codec
    by the name's suffix) reads it: a gzip file without that suffix is read undecompressed, so it is neither.
    A UTF-8 byte order mark and leading whitespace (blank lines) are skipped, as Spark's JSON reader does.
    """
    if gzipped and head.startswith(_GZIP_MAGIC):
        try:  # a head cut mid-stream decompresses as far as it goes
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, HEAD_BYTES)
        except zlib.error:
            return None  # Spark cannot read it either
    elif head.startswith(b"PAR1"):  # Spark's Parquet reader decompresses nothing: a gzipped Parquet file is neither
        return "parquet"
    elif gzipped:  # named *.gz, not gzip: Spark's JSON reader would fail to decompress it
        return None
    if head.removeprefix(_BOM).lstrip().startswith(b"{"):
        return "json"
    return None


def _head(spark: SparkSession, fs: Any, file: str) -> bytes:
    """The first :data:`HEAD_BYTES` of a file, through Hadoop (one Py4J call: ``InputStream.readNBytes``).

    Only files without a known extension get here.
    """
    jvm: Any = spark._jvm
    stream = fs.open(jvm.org.apache.hadoop.fs.Path(file))
    try:
        return bytes(stream.readNBytes(HEAD_BYTES))
    finally:
        stream.close()


def _local_head(path: str) -> bytes:
    """:func:`_head` of a local file, before any JVM starts."""
    with open(path, "rb") as file:
        return file.read(HEAD_BYTES)


def read_logs(spark: SparkSession, inputs: Sequence[str]) -> DeliveryLogs:
    """All records of ``inputs`` with the documented schema, checked, persisted.

    Raises AuditInputError for a missing path, no records, corrupt files or records, missing
    columns and unknown kinds.
    """

    files = find_files(spark, inputs)
    parts: list[DataFrame] = []
    if files.json:
        parts.append(_read_json(spark, files.json))
    for group in _parquet_groups(spark, files.parquet):
        parts.append(_read_parquet(spark, group))
    frame = parts[0]
    for part in parts[1:]:
        frame = frame.unionByName(part)
    frame = frame.persist(CACHE_LEVEL)
    try:
        kinds = _check(frame)
    except AuditInputError:
        unpersist([frame])
        raise
    except Exception as exc:
        unpersist([frame])
        unreadable = _unreadable_file(str(exc))
        if unreadable:  # a broken .gz, a Parquet data page damaged behind a sound footer
            raise AuditInputError(unreadable) from exc
        raise
    return DeliveryLogs(cached=frame, files=files, kinds=kinds)


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


def _parquet_groups(spark: SparkSession, paths: list[str]) -> list[list[str]]:
    """Parquet files grouped by schema, each checked: readable, with the required columns.

    Reading each file's schema here (its footer, through Spark: any Hadoop file system) names a
    truncated file plainly, and lets files written with other column types (``time`` as int64,
    ``qos`` as int64) be read and cast. The reads are small Spark jobs, run a few at a time.
    """

    with ThreadPoolExecutor(SCHEMA_READERS) as pool:
        schemas = list(pool.map(lambda path: _parquet_schema(spark, path), paths))
    groups: dict[str, list[str]] = {}
    for path, schema in zip(paths, schemas, strict=True):
        missing = [name for name in REQUIRED_ALWAYS if name not in schema.names]
        if missing:
            raise AuditInputError(
                f"{_file_name(path)} lacks the required column(s) {', '.join(missing)} (docs/delivery-log.md): "
                f"it has {', '.join(schema.names) or 'no columns'}"
            )
        odd = [
            name
            for name, data_type in COLUMNS
            if name in schema.names and not _convertible(schema[name].dataType, data_type)
        ]
        if odd:
            _check_empty_columns(spark, path, schema, odd)
        groups.setdefault(schema.simpleString(), []).append(path)
    return list(groups.values())


def _parquet_schema(spark: SparkSession, path: str) -> StructType:
    try:
        return spark.read.parquet(path).schema
    except Exception as exc:  # Py4JJavaError or Spark's own error classes, both with the cause in the text
        reason = _java_reason(exc) if isinstance(exc, Py4JJavaError) else str(exc).splitlines()[0]
        raise AuditInputError(
            f"{_file_name(path)} is not a readable Parquet file ({reason}): it may be truncated or still being "
            "written; rewrite it or leave it out"
        ) from exc


def _check_empty_columns(spark: SparkSession, path: str, schema: StructType, names: list[str]) -> None:
    """Columns of a type that does not convert are refused unless they hold no value at all.

    A column pyarrow wrote as null (every record of the file left it out) is INT32 in the file,
    which Spark reads as int; it holds nothing, so it is read as nulls.
    """
    counts = spark.read.parquet(path).select(*[sf.count(sf.col(name)).alias(name) for name in names]).first()
    for name in names:
        if counts is not None and counts[name]:
            want = dict(COLUMNS)[name]
            raise AuditInputError(
                f"column {name} of {_file_name(path)} is {schema[name].dataType.simpleString()}, which does not "
                f"convert to {want.simpleString()} (docs/delivery-log.md): rewrite the file with that type"
            )


INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def _convertible(have: DataType, want: DataType) -> bool:
    """Whether a Parquet column's Spark type casts to the documented one without losing its meaning."""
    if isinstance(have, NullType):
        return True
    if isinstance(want, StringType):
        return isinstance(have, StringType)
    if isinstance(want, BooleanType):
        return isinstance(have, BooleanType)
    if isinstance(want, DoubleType):
        return isinstance(have, (FloatType, DoubleType, DecimalType, *INTEGRAL))
    return isinstance(have, INTEGRAL) or (isinstance(have, DecimalType) and have.scale == 0)  # uint64: decimal(20,0)


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
