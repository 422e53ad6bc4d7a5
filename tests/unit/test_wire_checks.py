"""The one check of PUBLISH topics that every reader path uses (no broker needed)."""

from __future__ import annotations

import re

import pytest

from amqtt_durable.amqtt_glue import checked_publish_topic, publish_topic_problem
from amqtt_durable.errors import PacketTooLargeError, ProtocolViolationError
from amqtt_durable.topics import topic_problem


@pytest.mark.parametrize(
    ("topic", "words"),
    [
        ("", "empty"),
        ("k/a\x00b", "U+0000"),
        ("\x00", "U+0000"),
        ("k/+", "wildcard"),
        ("k/#", "wildcard"),
        ("a+b", "wildcard"),
        ("#", "wildcard"),
    ],
)
def test_invalid_topics_are_named(topic: str, words: str) -> None:
    problem = topic_problem(topic)
    assert problem is not None and words in problem
    with pytest.raises(ProtocolViolationError, match=re.escape(words)):
        checked_publish_topic(topic.encode("utf-8"))


@pytest.mark.parametrize("topic", ["k/a", "/", "a//b", " ", "k/\u00e9\u20ac", "_durable/ctl", "k/\x01"])
def test_valid_topics_pass(topic: str) -> None:
    assert topic_problem(topic) is None
    assert checked_publish_topic(topic.encode("utf-8")) == topic


def test_dollar_topics_are_the_brokers() -> None:
    assert topic_problem("$SYS/x") is None, "valid MQTT"
    assert "reserved for the broker" in (publish_topic_problem("$SYS/x") or "")


@pytest.mark.parametrize("raw", [b"k/\xff\xfe", b"\xc0\x80", b"k/\xed\xa0\x80"])  # bad byte, overlong NUL, surrogate
def test_bytes_that_are_not_utf8_are_refused(raw: bytes) -> None:
    with pytest.raises(ProtocolViolationError, match="not valid UTF-8"):
        checked_publish_topic(raw)


def test_packet_too_large_says_size_limit_and_what_to_do() -> None:
    error = PacketTooLargeError(2_097_152, 1_048_576)
    assert isinstance(error, ProtocolViolationError)
    assert "2097152 bytes" in str(error) and "max_packet_size (1048576 bytes)" in str(error)
    assert "broker.yaml" in str(error)
