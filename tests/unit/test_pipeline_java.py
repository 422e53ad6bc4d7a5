"""The pipeline's Java check against the machine's real JVM."""

from __future__ import annotations

import pytest

from durable_pipeline.spark import check_java


def test_java_tool_options_do_not_hide_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """With JAVA_TOOL_OPTIONS set, `java -version` prints "Picked up JAVA_TOOL_OPTIONS: ..." first; the check
    must still find the version line (it refused a Java 17 as 'needs Java 17 or newer')."""
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xss4m")
    check_java()
