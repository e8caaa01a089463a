"""An audit trail of committed sensor readings, outside the store (``store.commit_log``).

Sensors have nobody to acknowledge to, so "no committed reading is lost" needs
a witness that is not the store itself: after each commit returns, one JSON
line per sensor reading (origin, sensor, ts, value) is appended to this file.
It is written after the fsync it reports, never before, and is not itself
fsynced (a line missing after a crash only means the check knows less). The
power-cut tests and the demo compare it with what the pipeline delivered.

It is a fleet-file option (``store.commit_log: PATH``), not an environment
variable: until issue 25, ``PUBCOMP_COMMIT_LOG`` in the service's environment
turned it on, so a variable meant for a test acted in the installed product.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pubcomp.sync.store import Reading


class CommitLog:
    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def close(self) -> None:
        os.close(self.fd)

    def __call__(self, readings: Sequence[Reading], gateway: str) -> None:
        lines = [
            json.dumps(
                {"origin": r.origin or gateway, "sensor": r.sensor, "ts": r.ts, "value": r.value}
            )
            for r in readings
        ]
        if lines:
            os.write(self.fd, ("\n".join(lines) + "\n").encode())


def read(path: Path) -> set[tuple[str, str, int]]:
    """The logged readings as (origin, sensor, ts in µs since the epoch, UTC)."""
    out = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        t = datetime.fromisoformat(r["ts"].replace("Z", "+00:00"))
        out.add((r["origin"], r["sensor"], int(t.timestamp()) * 1_000_000 + t.microsecond))
    return out
