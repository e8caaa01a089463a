"""A real gateway under attack, and what the attack may cost (issue 25).

``Siege`` starts a cloud Mosquitto's checker, ``pubcomp gateway run`` (through
devkit's GatewayProc) and two well-behaved nodes that publish all along and
time every PUBACK; ``watch()`` then samples, while the attack runs, the
gateway's RSS (/proc/PID/status), its open file descriptors (/proc/PID/fd),
its log's size and its health endpoint. ``finish()`` stops the nodes and
checks at the cloud, with the independent paho checker, that every reading
they had acknowledged arrived exactly once.

The attackers here speak raw MQTT over their own sockets (bytes written by
hand, not by pubcomp's codec), from other loopback addresses (127.0.0.2 and
up: Linux routes all of 127/8 to lo), as a client on another host would.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from prometheus_client.parser import text_string_to_metric_families

from devkit.broker import Mosquitto
from devkit.checker import Checker, exactly_once_report
from devkit.gateway_helpers import GatewayProc
from devkit.node_helpers import wait_until
from pubcomp.sync.wire import wire_time

GOOD = {"good-1": "pw-good-1", "good-2": "pw-good-2"}
LATENCY_BOUND_S = 1.0  # a good node's PUBACK, publish to acknowledgement, retries included
HEALTH_TIMEOUT_S = 1.0


# ------------------------------------------------------------ raw MQTT, written by hand


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, b = n >> 7, n & 0x7F
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _s(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def connect_packet(
    user: bytes, password: bytes, client_id: bytes = b"", keepalive: int = 60
) -> bytes:
    """MQTT 3.1.1 CONNECT, clean session, with user name and password."""
    body = _s(b"MQTT") + b"\x04\xc2" + keepalive.to_bytes(2, "big")
    body += _s(client_id) + _s(user) + _s(password)
    return b"\x10" + _varint(len(body)) + body


def publish_packet(topic: str, payload: bytes, packet_id: int) -> bytes:
    body = _s(topic.encode()) + packet_id.to_bytes(2, "big") + payload
    return b"\x32" + _varint(len(body)) + body  # QoS 1


PINGREQ = b"\xc0\x00"


def subscribe_packet(packet_id: int) -> bytes:
    body = packet_id.to_bytes(2, "big") + _s(b"cmd/#") + b"\x01"
    return b"\x82" + _varint(len(body)) + body


def unsubscribe_packet(packet_id: int) -> bytes:
    body = packet_id.to_bytes(2, "big") + _s(b"cmd/#")
    return b"\xa2" + _varint(len(body)) + body


def pubrel_packet(packet_id: int) -> bytes:
    return b"\x62\x02" + packet_id.to_bytes(2, "big")


def raw_socket(port: int, source: str = "127.0.0.2", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # a client that reads nothing: let its window close early
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def read_connack(s: socket.socket, timeout: float = 15.0) -> int | None:
    """The CONNACK's return code; None if the gateway closed first."""
    s.settimeout(timeout)
    data = b""
    try:
        while len(data) < 4:
            chunk = s.recv(4 - len(data))
            if not chunk:
                return None
            data += chunk
    except (TimeoutError, ConnectionError):
        return None
    assert data[0] == 0x20, data
    return data[3]


# ------------------------------------------------------------ the good nodes


class TimedNode:
    """A node as the firmware behaves (QoS 1, 3.1.1; each message retried with the same
    (boot, seq) until its PUBACK) that times each message from its first publish to its
    PUBACK."""

    def __init__(self, node: str, password: str, port: int, *, gap: float = 0.05) -> None:
        self.node, self.gap = node, gap
        self.acked: list[int] = []
        self.latencies: list[tuple[float, float]] = []  # (when published, seconds to PUBACK)
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=node, protocol=mqtt.MQTTv311
        )
        self.client.username_pw_set(node, password)
        self.client.reconnect_delay_set(0.05, 0.5)
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TimedNode:
        self.client.connect_async("127.0.0.1", self.port, keepalive=5)
        self.client.loop_start()
        self._thread.start()
        return self

    def payload(self, seq: int) -> bytes:
        msg = {"v": 1, "node": self.node, "boot": 1, "seq": seq, "ts": wire_time()}
        msg["readings"] = [{"sensor": "t", "value": seq / 10, "unit": "C"}]
        return json.dumps(msg).encode()

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            payload, began = self.payload(seq), time.monotonic()
            while not self._acked(self.client.publish(f"nodes/{self.node}/readings", payload, 1)):
                while not self.client.is_connected() and not self._stop.is_set():
                    time.sleep(0.02)
            self.latencies.append((began, time.monotonic() - began))
            self.acked.append(seq)
            seq += 1
            self._stop.wait(self.gap)

    @staticmethod
    def _acked(info: mqtt.MQTTMessageInfo, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if info.is_published():
                    return True
            except RuntimeError:
                return False
            time.sleep(0.002)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.loop_stop()
        self.client.disconnect()

    def worst_since(self, t: float) -> float:
        return max((lat for began, lat in self.latencies if began >= t), default=0.0)

    def reading_ids(self) -> set[str]:
        return {f"{self.node}/1/{s}.0" for s in self.acked}


# ------------------------------------------------------------ what the gateway spends


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Costs:
    rss_kb: int = 0
    fds: int = 0
    log_bytes: int = 0
    max_rss_kb: int = 0
    max_fds: int = 0
    probes: int = 0
    probes_failed: list[str] = field(default_factory=list)
    slowest_probe_s: float = 0.0


class Siege:
    def __init__(
        self,
        tmp: Path,
        cloud: Mosquitto,
        *,
        nodes: dict[str, str] | None = None,
        ingress: dict[str, Any] | None = None,
    ) -> None:
        self.checker = Checker(cloud.port, topic="telemetry/#", client_id="siege-checker").start()
        extra = {"ingress": {"write_timeout_s": 2.0, **(ingress or {})}}
        self.gw = GatewayProc(tmp, cloud.port, nodes={**GOOD, **(nodes or {})}, extra=extra)
        self.gw.start()
        assert self.gw.proc is not None
        self.pid = self.gw.proc.pid
        self.good = [TimedNode(n, p, self.gw.ingress_port).start() for n, p in GOOD.items()]
        assert wait_until(lambda: all(len(n.acked) >= 5 for n in self.good), 30), self.log_tail()
        self.base = Costs(rss_kb(self.pid), fds(self.pid), self.gw.log.stat().st_size)
        self.costs = Costs()
        self.attack_began = 0.0

    def log_tail(self, n: int = 3000) -> str:
        return self.gw.log.read_text(errors="replace")[-n:]

    @contextmanager
    def watch(self) -> Iterator[Costs]:
        """Sample the gateway's costs while the body (the attack) runs."""
        stop = threading.Event()
        c = self.costs

        def sample() -> None:
            while not stop.is_set():
                c.max_rss_kb = max(c.max_rss_kb, rss_kb(self.pid))
                c.max_fds = max(c.max_fds, fds(self.pid))
                began = time.monotonic()
                c.probes += 1
                try:
                    with urllib.request.urlopen(
                        self.gw.url("/healthz"), timeout=HEALTH_TIMEOUT_S
                    ) as r:
                        if r.status != 200:
                            c.probes_failed.append(f"status {r.status}")
                except OSError as exc:
                    c.probes_failed.append(repr(exc))
                c.slowest_probe_s = max(c.slowest_probe_s, time.monotonic() - began)
                stop.wait(0.2)

        t = threading.Thread(target=sample, daemon=True)
        self.attack_began = time.monotonic()
        t.start()
        try:
            yield c
        finally:
            wait_until(lambda: c.probes >= 5, 5)  # a second of probes at least, however short
            stop.set()
            t.join(10)
            c.rss_kb, c.fds = rss_kb(self.pid), fds(self.pid)
            c.log_bytes = self.gw.log.stat().st_size - self.base.log_bytes

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(self.gw.url("/metrics"), timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    def finish(self, *, rss_mb: float, fds: int, log_kb: float) -> dict[str, Any]:
        """Stop the good nodes and check everything the attack may not have cost: their
        PUBACKs under LATENCY_BOUND_S, nothing of theirs lost or doubled at the cloud,
        every health probe answered, and RSS, descriptors and log growth under the bounds
        given (over the gateway's own before the attack). Returns the figures."""
        c = self.costs
        for n in self.good:
            n.stop()
        worst = max(n.worst_since(self.attack_began) for n in self.good)
        expected = set().union(*(n.reading_ids() for n in self.good))
        counts = self.checker.wait_for(expected, 60)
        report = exactly_once_report(collections_filter(counts, tuple(GOOD)), expected)
        figures = {
            "worst_puback_s": round(worst, 3),
            "acked": {n.node: len(n.acked) for n in self.good},
            "probes": c.probes,
            "probes_failed": len(c.probes_failed),
            "slowest_probe_s": round(c.slowest_probe_s, 3),
            "rss_growth_mb": round((c.max_rss_kb - self.base.rss_kb) / 1024, 1),
            "fds_before": self.base.fds,
            "fds_max": c.max_fds,
            "log_growth_kb": round(c.log_bytes / 1024, 1),
        }
        print("siege figures:", json.dumps(figures))
        self.checker.stop()
        assert self.gw.terminate() == 0, self.log_tail()
        assert report["missing"] == 0 and report["duplicated"] == 0, report
        assert worst < LATENCY_BOUND_S, figures
        assert not c.probes_failed, (c.probes_failed[:5], figures)
        assert c.probes >= 5, figures
        assert figures["rss_growth_mb"] < rss_mb, figures
        assert c.max_fds - self.base.fds < fds, figures
        assert c.log_bytes < log_kb * 1024, (figures, self.log_tail())
        log = self.gw.log.read_text(errors="replace")
        assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
        return figures


def collections_filter(counts: Any, nodes: tuple[str, ...]) -> Any:
    """Only the good nodes' readings (an attacker's may reach the cloud too)."""
    return type(counts)({k: v for k, v in counts.items() if k.split("/", 1)[0] in nodes})
