"""Run ``pubcomp gateway run`` as a real process, and nodes that publish to it with paho-mqtt."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

import paho.mqtt.client as mqtt
import yaml

from pubcomp.gateway.config import GatewayConfig
from pubcomp.gateway.credentials import hash_password
from pubcomp.gateway.status import fetch as fetch_status
from pubcomp.sync.wire import wire_time

from . import hooked
from .broker import free_port
from .procs import track


def offline_config(tmp: Path, gid: str, **extra: Any) -> GatewayConfig:
    """An in-process gateway's config whose uplink points where nothing listens (port 9):
    every reading waits in its store (``tmp/gw.db``), and its health port is any free one."""
    return GatewayConfig.model_validate(
        {
            "id": gid,
            "fleet": "t",
            "uplink": {"broker": "mqtt://127.0.0.1:9"},
            "store": {"path": str(tmp / "gw.db")},
            "health": {"port": 0},
            **extra,
        }
    )


class GatewayProc:
    """A fleet file for one gateway, and the process running it."""

    def __init__(
        self,
        tmp: Path,
        cloud_port: int,
        *,
        gid: str = "gw-e2e",
        sensors: list[dict[str, Any]] | None = None,
        nodes: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.tmp, self.gid = tmp, gid
        self.db = tmp / "state" / "gateway.db"
        self.ingress_port, self.health_port = free_port(), free_port()
        self.nodes = nodes or {}
        self.sensors = sensors or []
        self.cloud_port = cloud_port
        self.extra = extra or {}
        self.fleet = tmp / "fleet.yaml"
        self.write()
        self.proc: subprocess.Popen[str] | None = None
        self.log = tmp / "gateway.log"

    def write(self) -> None:
        gw: dict[str, Any] = {
            "uplink": {"broker": f"mqtt://127.0.0.1:{self.cloud_port}", "keepalive": 5},
            "store": {"path": str(self.db)},
            "ingress": {"host": "127.0.0.1", "port": self.ingress_port},
            "health": {"port": self.health_port},
            "gpio": "simulated",
            "sensors": self.sensors,
            "nodes": [{"id": n, "password_hash": hash_password(p)} for n, p in self.nodes.items()],
        }
        for k, v in self.extra.items():
            gw[k] = v | gw.get(k, {}) if isinstance(v, dict) else v
        self.fleet.write_text(yaml.safe_dump({"fleet": "e2e", "gateways": {self.gid: gw}}))

    def run_args(self) -> list[str]:
        """What ``pubcomp gateway run`` is given before ``--gateway``."""
        return ["--config", str(self.fleet)]

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> Self:
        # Through devkit/hooked.py: the hooks in ``env`` (crash points, a forced clock
        # state) act only there, never in the product (issue 25).
        cmd = hooked.command("gateway", "run", *self.run_args())
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--gateway", self.gid],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
            )
        track(self.proc)
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url("/healthz"), timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not healthy: {self.log.read_text()[-3000:]}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.health_port}{path}"

    def status(self) -> dict[str, Any]:
        return fetch_status("127.0.0.1", self.health_port)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(timeout)

    def store_facts(self) -> tuple[str, int]:
        """(epoch, last seq) read straight from the SQLite file, with the gateway stopped."""
        db = sqlite3.connect(self.db)
        try:
            epoch = db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()[0]
            floor = db.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
            top = db.execute("SELECT MAX(seq + n - 1) FROM outbox").fetchone()[0]
        finally:
            db.close()
        return epoch, max(int(floor[0]) if floor else 0, top or 0)


class PahoNode:
    """A node as the firmware behaves: QoS 1, each message retried with the same (boot, seq)
    until its PUBACK arrives, across disconnects and gateway restarts."""

    def __init__(self, node: str, password: str, port: int, *, boot: int = 1, per_msg: int = 3):
        self.node, self.boot, self.per_msg = node, boot, per_msg
        self.acked: list[int] = []
        self.retries = 0
        self.interrupted = 0  # messages retried, or acknowledged only after a reconnect
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=node, protocol=mqtt.MQTTv311
        )
        self.client.username_pw_set(node, password)
        self.client.reconnect_delay_set(0.05, 0.5)
        self.connects = 0
        self.client.on_connect = self._on_connect
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_connect(self, *_: Any) -> None:
        self.connects += 1

    def payload(self, seq: int) -> bytes:
        ts = wire_time()
        readings = [{"sensor": f"n{i}", "value": seq + i / 10, "unit": "C"} for i in range(3)]
        msg = {"v": 1, "node": self.node, "boot": self.boot, "seq": seq, "ts": ts}
        return json.dumps({**msg, "readings": readings[: self.per_msg]}).encode()

    def start(self) -> PahoNode:
        self.client.connect_async("127.0.0.1", self.port, keepalive=5)
        self.client.loop_start()
        self._thread.start()
        return self

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            payload = self.payload(seq)
            connects = self.connects
            tries = 0
            while not self._acked(self.client.publish(self.topic, payload, qos=1)):
                self.retries += 1  # no PUBACK: the same message again
                tries += 1
                while not self.client.is_connected():
                    time.sleep(0.02)
            # paho resends an unacknowledged message itself after a reconnect
            self.interrupted += tries > 0 or self.connects != connects
            self.acked.append(seq)
            seq += 1
            time.sleep(0.01)

    @property
    def topic(self) -> str:
        return f"nodes/{self.node}/readings"

    @staticmethod
    def _acked(info: mqtt.MQTTMessageInfo, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if info.is_published():
                    return True
            except RuntimeError:  # paho dropped it: not connected
                return False
            time.sleep(0.005)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.loop_stop()
        self.client.disconnect()

    def reading_ids(self) -> set[str]:
        return {f"{self.node}/{self.boot}/{s}.{i}" for s in self.acked for i in range(self.per_msg)}
