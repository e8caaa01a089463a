"""Run the node firmware as a CPython process (firmware/host/run_node.py) against a gateway."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .procs import track

RUNNER = Path(__file__).resolve().parents[1] / "firmware" / "host" / "run_node.py"
DEEPSLEEP_EXIT = 75


def node_config(node: str, password: str, port: int, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "wifi": {"ssid": "test", "password": "x", "timeout_s": 1},
        "gateway": {"host": "127.0.0.1", "port": port, "keepalive_s": 5, "timeout_s": 3},
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


class NodeProc:
    """One board: a flash directory (config.json, boot.txt, spill/) and the process on it."""

    def __init__(self, flash: Path, cfg: dict[str, Any]) -> None:
        self.flash = flash
        flash.mkdir(parents=True, exist_ok=True)
        (flash / "config.json").write_text(json.dumps(cfg))
        self.node = cfg["node"]["id"]
        self.log = flash.parent / f"{flash.name}.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> NodeProc:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(RUNNER), str(self.flash)],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        track(self.proc)
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


def wait_until(pred: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
