"""The SDK's link uses paho internals (held re-sends, PUBREL kept across a reconnect): a paho-mqtt
without them is refused at connect(), naming what is missing, rather than misbehaving later."""

from __future__ import annotations

import tomllib
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from durable_client import DurableClient, DurableClientError
from durable_client._paho import PAHO_WRITTEN_FOR

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        (mqtt.Client, "_update_inflight", "_update_inflight"),
        (mqtt.MQTTMessageInfo, "_set_as_published", "MQTTMessageInfo._set_as_published"),
    ],
)
def test_connect_refuses_a_paho_without_the_internals_the_link_uses(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, named: str
) -> None:
    monkeypatch.delattr(owner, name)
    client = DurableClient("paho-release", port=1, durable_session=False)
    with pytest.raises(DurableClientError) as refused:
        client.connect(timeout=1)
    message = str(refused.value)
    assert f"lacks {named}." in message, message
    assert f"durable_client was written for {PAHO_WRITTEN_FOR}" in message, message
    assert f"pip install '{PAHO_WRITTEN_FOR}'" in message, message


def test_the_pinned_range_is_the_one_the_link_names() -> None:
    """pyproject's dependency and the error's advice name the same releases."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    assert PAHO_WRITTEN_FOR in pyproject["project"]["dependencies"]
