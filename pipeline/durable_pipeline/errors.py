"""The pipeline's errors: each says what happened, what it affects and what to do."""

from __future__ import annotations

PIPELINE_EXTRA = ("pyspark", "pandas", "pyarrow", "py4j", "matplotlib", "psutil")
"""The ``pipeline`` extra's modules (pyspark[sql] brings pandas, pyarrow and py4j; psutil is the fleet's)."""


def missing_extra(exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` is a module of the pipeline extra not installed: the command says so (exit status 2).
    Any other module missing, or an ImportError of another kind, is a fault to raise, not the extra."""
    return (exc.name or "").partition(".")[0] in PIPELINE_EXTRA


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose (bad input, an unreachable broker)."""


class SourceError(PipelineError):
    """The amqtt-durable data source cannot read what was asked (unknown stream, trimmed offsets)."""


class AuditInputError(PipelineError):
    """Delivery logs the audit cannot use (missing columns, corrupt files)."""
