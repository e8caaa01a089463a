"""Status messages as the cloud sees them: a paho subscriber that keeps every one per gateway."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from pubcomp.sync import wire

STATUS_SCHEMA = "gateway-status.v1.json"


class StatusWatcher:
    """Subscribes to ``{prefix}/+/status`` and keeps each message (and whether it came retained)."""

    def __init__(self, port: int, topic: str = "telemetry/+/status", name: str = "watcher"):
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.invalid: list[str] = []
        self._lock = threading.Lock()
        self._validator = wire.validator(STATUS_SCHEMA)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, m: mqtt.MQTTMessage) -> None:
        msg = json.loads(m.payload)
        errors = [e.message for e in self._validator.iter_errors(msg)]
        with self._lock:
            if errors:
                self.invalid.append(f"{m.topic}: {errors}")
            msg["_retained"] = bool(m.retain)
            msg["_topic"] = m.topic
            self.messages.setdefault(msg["gateway"], []).append(msg)

    def latest(self, gateway: str) -> dict[str, Any] | None:
        with self._lock:
            got = self.messages.get(gateway)
            return got[-1] if got else None

    def all(self, gateway: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.messages.get(gateway, []))

    def wait(
        self, gateway: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> dict[str, Any]:
        """The first message (kept, or arriving) of ``gateway`` that satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            msgs = self.all(gateway)
            for m in msgs[seen:]:
                if pred(m):
                    return m
            seen = len(msgs)
            time.sleep(0.05)
        raise TimeoutError(f"{gateway}: no such status; last: {self.latest(gateway)}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
