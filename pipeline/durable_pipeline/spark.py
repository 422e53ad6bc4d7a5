"""One way to get a SparkSession: local mode by default, a cluster by changing ``master``.

Python workers must run this interpreter (with pyarrow and the project installed), not
whatever ``python3`` is on the PATH, hence PYSPARK_PYTHON; Spark 4 is built for Java 17.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .errors import AuditInputError, PipelineError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("durable_pipeline.spark")
DEFAULT_MASTER = "local[2,4]"
"""Two cores; a failed task is tried up to 4 times, as a cluster does (plain local[2] gives up at once)."""
_MASTER = re.compile(
    r"local(\[(\*|[1-9][0-9]*)(\s*,\s*[0-9]+)?\])?"
    r"|local-cluster\[\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*\]"
    r"|yarn|(spark|k8s)://\S+"
)
"""The master URLs Spark takes (SparkMasterRegex, and SparkSubmit's yarn, spark:// and k8s://)."""
URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")
"""A path that names a file system (``hdfs://nn/x``, ``file:/x``); anything else is a local path."""


def check_out_folder(out: str | os.PathLike[str]) -> None:
    """``--out`` is a local folder on the driver: a URI (hdfs://, s3a://, file://) is refused, not taken for a
    local folder named after it."""
    if URI.match(os.fspath(out)):
        raise AuditInputError(
            f"--out {os.fspath(out)} is a URI: the summary, report and charts go to a local folder on the driver "
            "(the machine running the audit); name a local path"
        )


def check_master(master: str) -> None:
    """PipelineError naming ``master`` unless Spark would take it: before a JVM starts (and, for the fleet,
    before its run), instead of Spark's gateway error once it has."""
    if not _MASTER.fullmatch(master):
        raise PipelineError(
            f"--master {master!r} is not a Spark master URL: use local, local[N] or local[N,F] (N threads or *, "
            "F attempts per task), local-cluster[N,C,M], spark://HOST:PORT, yarn or k8s://HOST:PORT"
        )


def check_java() -> None:
    """Spark needs a JVM (17 or newer): say so plainly instead of Spark's gateway traceback."""
    home = os.environ.get("JAVA_HOME")
    java = (shutil.which("java", path=os.path.join(home, "bin")) if home else None) or shutil.which("java")
    if java is None:
        raise PipelineError(
            "Spark needs Java 17 or newer and no `java` was found: install a JDK 17 "
            "(apt install openjdk-17-jre-headless) or set JAVA_HOME"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False).stderr
    # The version line, not the first: with JAVA_TOOL_OPTIONS set the JVM prints "Picked up ..." before it.
    lines = out.splitlines()
    first = next((line for line in lines if " version " in line), lines[0] if lines else "")
    version = first.split('"')[1] if first.count('"') >= 2 else ""
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < 17:
        raise PipelineError(
            f"Spark needs Java 17 or newer; {java} reports {first or 'no version'}: install a JDK 17 or set JAVA_HOME"
        )


def get_session(master: str = DEFAULT_MASTER, app_name: str = "amqtt-durable") -> SparkSession:
    """A SparkSession with the ``amqtt-durable`` data source registered; local mode stays on 127.0.0.1.

    Spark's ``getOrCreate``: a process that already runs a SparkSession (a notebook's, a test session's) gets
    that one, its master and other static settings unchanged (``master`` is not applied to it); the runtime
    settings set here (``spark.sql.shuffle.partitions`` for a local ``master``) are applied to it."""
    check_master(master)
    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # pyspark loads here, not at import: `durable-pipeline --help` and the broker stay light.
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from .source import AmqttDurableDataSource  # noqa: PLC0415
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode talks to itself only
        builder = (
            builder.config("spark.sql.shuffle.partitions", "4")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
        )
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # the JVM's own output (above, on stderr) says more
        raise PipelineError(f"Spark did not start on master {master!r}: {exc}") from exc
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(AmqttDurableDataSource)
    return session


def running_session() -> SparkSession | None:
    """The SparkSession this process already runs, started in any thread (a notebook's, a test session's), or
    None when no SparkContext runs: no JVM is started. The calling thread's active session if it has one, else
    the process's default session (one is made on the running SparkContext if it has none; nothing is changed)."""
    from pyspark import SparkContext  # noqa: PLC0415
    from pyspark.sql import SparkSession  # noqa: PLC0415

    if SparkContext._active_spark_context is None:  # pyspark has no public "is a context running" call
        return None
    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()  # no options: none applied


def stop_session(spark: SparkSession) -> None:
    """``spark.stop()`` for cleanup code, never raising: a JVM that died (an OutOfMemoryError) makes
    stop fail with "connection refused", which would hide the job's own error. Logged instead."""
    try:
        spark.stop()
    except Exception:  # whatever it is: the job's own error (if any) must get through
        log.warning("could not stop the SparkSession (did its JVM exit?)", exc_info=True)


@contextmanager
def job_session(master: str, app_name: str) -> Iterator[SparkSession]:
    """The session a job (the audit, the demo) runs in: the one this process already runs (any thread's, see
    :func:`running_session`), with ``master`` then not used, left running and as it was (its settings and log
    level unchanged; only the ``amqtt-durable`` data source is registered in it); else a new one from
    :func:`get_session` on ``master``, stopped when the job ends: only a session the job started is the job's
    to stop. Looking for a running session and starting one happen under the lock pyspark's
    ``SparkSession.builder.getOrCreate()`` takes, so a session another thread starts that way meanwhile is not
    taken for the job's own."""
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from .source import AmqttDurableDataSource  # noqa: PLC0415

    with SparkSession.Builder._lock:  # the lock every SparkSession.builder.getOrCreate() takes (an RLock)
        running = running_session()
        if running is None:
            spark = get_session(master, app_name)
        else:
            spark = running
            spark.dataSource.register(AmqttDurableDataSource)
    try:
        yield spark
    finally:
        if running is None:
            stop_session(spark)
