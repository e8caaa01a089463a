"""Run ``pubcomp ingest run`` as a real process and read what it landed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pubcomp.pipeline.audit import landed

from .procs import track

__all__ = ["IngestProc", "landed", "malformed_lines", "rejected"]


class IngestProc:
    def __init__(self, port: int, landing: Path, client_id: str = "ingest-1", *extra: str):
        self.port, self.landing, self.client_id, self.extra = port, landing, client_id, extra
        self.log = landing.parent / f"{client_id}.log"
        self.marker = landing.parent / f"{client_id}.crash"  # what a crash point writes
        self.proc: subprocess.Popen[str] | None = None
        self.runs = 0

    def start(self, crash_at: str | None = None, wait: bool = True) -> IngestProc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PUBCOMP_CRASH_")}
        self.marker.unlink(missing_ok=True)
        if crash_at:
            env["PUBCOMP_CRASH_AT"] = crash_at
            env["PUBCOMP_CRASH_MARKER"] = str(self.marker)
        self.runs += 1
        mark = f"run {self.runs}\n"
        with self.log.open("a") as f:
            f.write(mark)
        cmd = [sys.executable, "-m", "pubcomp", "-v", "ingest", "run"]
        cmd += ["--broker", f"mqtt://127.0.0.1:{self.port}", "--client-id", self.client_id]
        cmd += ["--landing", str(self.landing), "--roll-s", "0.5", "--keepalive", "5"]
        with self.log.open("a") as f:
            self.proc = subprocess.Popen(
                [*cmd, *self.extra], env=env, stdout=subprocess.PIPE, stderr=f, text=True
            )
        track(self.proc)
        if wait:
            self.wait_subscribed(mark)
        return self

    def wait_subscribed(self, mark: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()
            if "subscribed to" in text[text.rfind(mark) :]:
                return
            assert self.proc is not None and self.proc.poll() is None, text[-3000:]
            time.sleep(0.05)
        raise TimeoutError(self.log.read_text()[-3000:])

    def crashed_at(self) -> str:
        """What the crash point wrote before the kill ("" if none fired)."""
        return self.marker.read_text().strip() if self.marker.exists() else ""

    def stop(self) -> dict[str, object]:
        assert self.proc is not None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])


def rejected(landing: Path) -> list[dict[str, str]]:
    return [
        json.loads(line)
        for f in sorted(landing.glob("_rejected/date=*/*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def malformed_lines(landing: Path) -> list[str]:
    """Lines of rolled files (readings, ``_rejected``, ``_status``: where Spark, the audit
    and the fleet view read) that are not a JSON object: ``file:line: repr``."""
    bad = []
    for pattern in ("date=*/*.jsonl", "_rejected/date=*/*.jsonl", "_status/date=*/*.jsonl"):
        for f in sorted(landing.glob(pattern)):
            for n, line in enumerate(f.read_bytes().split(b"\n")[:-1], 1):
                try:
                    ok = isinstance(json.loads(line), dict)
                except ValueError:
                    ok = False
                if not ok:
                    bad.append(f"{f.relative_to(landing)}:{n}: {line[:80]!r}")
    return bad
