"""Status messages as the cloud sees them: a paho subscriber that keeps every one per gateway."""

from __future__ import annotations

import contextlib
import json
import socket
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

    def mark(self, gateway: str) -> int:
        """How many messages of ``gateway`` came so far (for ``wait(after=...)``)."""
        return len(self.all(gateway))

    def wait(
        self,
        gateway: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float = 60.0,
        after: int = 0,
    ) -> dict[str, Any]:
        """The first message of ``gateway`` after the first ``after`` that satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        seen = after
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


def _varint(sock: socket.socket, first: bytes) -> tuple[int, bytes]:
    """An MQTT remaining length read from the socket (and the bytes read)."""
    n, mult, raw = 0, 1, b""
    while True:
        b = sock.recv(1)
        if not b:
            raise ConnectionError("closed in the fixed header")
        raw += b
        n += (b[0] & 0x7F) * mult
        if not b[0] & 0x80:
            return n, first + raw
        mult *= 128


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed mid-packet")
        out += chunk
    return out


def connect_client_id(packet: bytes) -> str:
    """The client id in a CONNECT's variable header and payload (3.1.1 and 5.0)."""
    i = 2 + int.from_bytes(packet[0:2], "big")  # protocol name
    level = packet[i]
    i += 1 + 1 + 2  # level, flags, keepalive
    if level == 5:  # properties: a variable byte integer length, then the properties
        n, mult = 0, 1
        while True:
            b = packet[i]
            i += 1
            n += (b & 0x7F) * mult
            if not b & 0x80:
                break
            mult *= 128
        i += n
    size = int.from_bytes(packet[i : i + 2], "big")
    return packet[i + 2 : i + 2 + size].decode()


class CutProxy:
    """A TCP relay to the broker that can cut the connections of one MQTT client id.

    A cut client's connections are closed, and new ones closed right after their
    CONNECT, until ``restore``; every other client (a gateway's status link) passes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.cut_ids: set[str] = set()
        self._conns: list[tuple[str, socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.refused = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            first = _recv_exact(client, 1)
            size, head = _varint(client, first)
            body = _recv_exact(client, size)
            cid = connect_client_id(body)
        except (OSError, ConnectionError, IndexError, UnicodeDecodeError):
            client.close()
            return
        with self._lock:
            if cid in self.cut_ids:
                self.refused += 1
                client.close()
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self._conns.append((cid, client, up))
        up.sendall(head + body)
        threading.Thread(target=self._pump, args=(up, client), daemon=True).start()
        self._pump(client, up)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self, client_id: str) -> None:
        with self._lock:
            self.cut_ids.add(client_id)
            for cid, a, b in self._conns:
                if cid == client_id:
                    for s in (a, b):
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)

    def restore(self, client_id: str) -> None:
        with self._lock:
            self.cut_ids.discard(client_id)

    def close(self) -> None:
        self._closed = True
        self.server.close()
        with self._lock:
            for _, a, b in self._conns:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.close()
