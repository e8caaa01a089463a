"""A node board on this machine: the firmware's host port (firmware/host/run_node.py) in a process.

One flash directory per board (config.json, boot.txt, spill/) as on the
device. Used by the demo, the tests and the benchmarks; needs a checkout
(the firmware is not part of the Python package) and umqtt.simple fetched by
``make setup`` (scripts/fetch-umqtt.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve().parents[1] / "firmware" / "host" / "run_node.py"


def node_config(node: str, password: str, host: str, port: int, **over: Any) -> dict[str, Any]:
    """A board's config.json; ``over`` replaces keys (dicts are merged one level deep)."""
    cfg: dict[str, Any] = {
        "wifi": {"ssid": "demo", "password": "x", "timeout_s": 1},
        "gateway": {"host": host, "port": port, "keepalive_s": 5, "timeout_s": 3},
        "node": {"id": node, "password": password},
        "interval_s": 0.01,
        "buffer_readings": 500,
        "spill": {"mode": "always", "dir": "spill", "segments": 4, "segment_bytes": 1 << 20},
        "ntp": False,
        "wdt_ms": 15000,
        "sensors": [
            {"kind": "adc", "name": "a", "pin": 26, "scale": 0.001, "unit": "V"},
            {"kind": "adc", "name": "b", "pin": 27, "scale": 0.01, "unit": "mA"},
        ],
    }
    for k, v in over.items():
        cfg[k] = cfg[k] | v if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg


class HostNode:
    """One board: its flash directory and the process running the firmware on it."""

    def __init__(self, flash: Path, cfg: dict[str, Any]) -> None:
        self.flash = flash
        flash.mkdir(parents=True, exist_ok=True)
        (flash / "config.json").write_text(json.dumps(cfg))
        self.node = cfg["node"]["id"]
        self.log = flash.parent / f"{flash.name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}  # e.g. PUBCOMP_ESP32_DIR: an ESP32 with OTA partitions

    def esp32(self) -> Path:
        """Make this board an ESP32 with two OTA partitions (firmware/host/standins/esp32.py)."""
        part = self.flash.parent / f"{self.flash.name}.partitions"
        self.env["PUBCOMP_ESP32_DIR"] = str(part)
        return part

    def start(self) -> HostNode:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(RUNNER), str(self.flash)],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **self.env},
            )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def taken(self) -> dict[str, int]:
        """Every reading id the node put in its flash log (spill "always": all it took)."""
        ids: dict[str, int] = {}
        for f in sorted((self.flash / "spill").glob("*.log")):
            for line in f.read_bytes().split(b"\n"):
                if line.startswith(b"M ") and line.endswith(b";"):
                    boot, seq, _t, flat = json.loads(line[2:-1])
                    for i in range(len(flat) // 3):
                        ids[f"{self.node}/{boot}/{seq}.{i}"] = 1
        return ids

    def boots(self) -> int:
        return int((self.flash / "boot.txt").read_text())

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""
