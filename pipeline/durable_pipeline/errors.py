"""The pipeline's errors: each says what happened, what it affects and what to do."""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose (bad input, an unreachable broker)."""


class SourceError(PipelineError):
    """The amqtt-durable data source cannot read what was asked (unknown stream, trimmed offsets)."""


class AuditInputError(PipelineError):
    """Delivery logs the audit cannot use (missing columns, corrupt files)."""
