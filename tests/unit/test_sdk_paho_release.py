"""The SDK's link uses paho internals (held re-sends, PUBREL kept across a reconnect): a paho-mqtt
without them is refused at connect(), naming what is missing, rather than misbehaving later."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from durable_client import DurableClient, DurableClientError
from durable_client._paho import _CLIENT_INTERNALS, _FAST_PATH_INTERNALS, PAHO_WRITTEN_FOR, PahoLink

pytestmark = pytest.mark.timeout(30)


def without(name: str) -> Callable[..., None]:
    """A paho Client.__init__ that leaves out ``name`` (an attribute it sets, or hides a method it has)."""
    made = mqtt.Client.__init__

    def init(self: mqtt.Client, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if name in vars(self):
            delattr(self, name)

    return init


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        *((mqtt.Client, name, name) for name in _CLIENT_INTERNALS),
        (mqtt.MQTTMessageInfo, "_set_as_published", "MQTTMessageInfo._set_as_published"),
    ],
)
def test_connect_refuses_a_paho_without_the_internals_the_link_uses(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, named: str
) -> None:
    if hasattr(owner, name):  # a method (or class attribute)
        monkeypatch.delattr(owner, name)
    else:  # an attribute each client sets in __init__
        monkeypatch.setattr(mqtt.Client, "__init__", without(name))
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


def test_every_paho_internal_the_link_reaches_for_is_checked() -> None:
    """A private of paho's client used in _paho.py (``client._x``, ``self._client._x``) is in what
    check_paho refuses without, or in the fast path's list, which falls back without it."""
    source = Path(__file__).resolve().parents[2] / "client_sdk" / "durable_client" / "_paho.py"
    used = {
        node.attr
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "client")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "_client")
        )
    }
    assert {"_out_messages", "_sock"} <= used, sorted(used)  # the walk finds them
    assert not (unchecked := used - set(_CLIENT_INTERNALS) - set(_FAST_PATH_INTERNALS)), sorted(unchecked)


def test_the_link_hears_of_acknowledgements_only_not_of_each_qos0_write() -> None:
    """The link learns of a PUBACK or PUBCOMP from paho's handling of it, not from paho's on_publish:
    paho calls that one at every QoS 0 write too (a PUBACK ReasonCode and Properties built, two locks
    taken), which doubled a QoS 0 publish's CPU for every client (review 319: 24-37 -> 49-55 us)."""
    heard: list[int] = []
    link = PahoLink(
        "acks-only", "127.0.0.1", 1, keepalive=60, clean_session=True, username=None, password=None,
        connect_timeout=1, on_connack=lambda _ack: None, on_message=lambda _msg: None,
        on_lost=lambda _why: None, on_subscribed=lambda _mid, _ok: None,
        on_published=lambda mid, _info: heard.append(mid),
    )
    paho = link._client
    assert paho.on_publish is None  # paho's QoS 0 write path then runs no callback
    info = mqtt.MQTTMessageInfo(7)
    paho._out_messages[7] = mqtt.MQTTMessage(mid=7)
    paho._out_messages[7].info = info
    paho._out_messages[7].qos = 1
    paho._inflight_messages = 1
    paho._do_on_publish(7, mqtt.ReasonCode(mqtt.PacketTypes.PUBACK), mqtt.Properties(mqtt.PacketTypes.PUBACK))
    assert heard == [7]
    assert info.is_published() and 7 not in paho._out_messages  # paho's own handling ran after
