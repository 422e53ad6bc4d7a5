"""Delivery logs (docs/delivery-log.md, version 1): what this client sent and processed, for the
delivery audit (``durable-pipeline audit``) of any test run."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any

from .events import Event
from .protocol import Marker


def message_id(topic: str, payload: bytes) -> str:
    """The same id on the publisher's and the receiver's side, with nothing added to the payload."""
    return hashlib.sha256(topic.encode("utf-8") + b"\x00" + payload).hexdigest()[:32]


class DeliveryLog:
    """Appends one JSON line per record and flushes it: a SIGKILL keeps every record written."""

    def __init__(self, path: str | os.PathLike[str], device: str) -> None:
        folder = os.path.dirname(os.fspath(path))
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the client's life
        self._device = device
        self._lock = threading.Lock()

    def _write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "device": self._device, "time": time.time(), **fields})
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def send(self, topic: str, payload: bytes, qos: int) -> None:
        self._write("send", topic=topic, id=message_id(topic, payload), qos=qos)

    def receive(self, event: Event) -> None:
        self._write(
            "receive",
            topic=event.topic,
            id=message_id(event.topic, event.payload),
            qos=event.qos,
            replayed=event.replayed,
            redelivered=event.redelivered,
            seq=event.seq,
            epoch=event.epoch,
            published_at=event.published_at,
        )

    def subscribe(self, topic_filter: str, qos: int, durable: bool) -> None:
        self._write("subscribe", topic=topic_filter, qos=qos, durable=durable)

    def unsubscribe(self, topic_filter: str) -> None:
        self._write("unsubscribe", topic=topic_filter)

    def session_end(self) -> None:
        self._write("session_end")

    def connect(self, session_present: bool) -> None:
        self._write("connect", session_present=session_present)

    def live(self, marker: Marker) -> None:
        self._write("live", replayed_count=marker.replayed)

    def close(self) -> None:
        with self._lock:
            self._file.close()
