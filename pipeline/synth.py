"""Synthetic landing files, for trying the pipeline, its tests and its benchmark.

Readings look like the ingest's output: one JSON object a line with the
gateway and the time the ingest received it. Knobs: duplicates (the same
reading landed again, later), late readings (received up to ``late_max_s``
after their time), values on a 1/16 grid like a DS18B20's, some without a
clock (``clock_unsynced``).
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ..sync.wire import wire_time


def _iso(t: datetime) -> str:
    return wire_time(t)


def write_landing(
    root: Path,
    n: int,
    *,
    origins: int = 10,
    sensors: int = 100,
    dup_rate: float = 0.05,
    late_rate: float = 0.01,
    late_max_s: float = 5400.0,
    start: datetime = datetime(2026, 11, 20, tzinfo=UTC),
    span_s: float = 2 * 86400.0,
    seed: int = 1,
    files: int = 4,
    name: str = "synth",
    id_offset: int = 0,
) -> int:
    """Write ``n`` distinct readings (plus duplicates) into ``files`` files; returns lines."""
    rng = random.Random(seed)
    step = span_s / max(1, n)
    out: list[list[str]] = [[] for _ in range(files)]
    lines = 0
    for i in range(n):
        k = i + id_offset
        origin = f"gw{k % origins:03d}"
        sensor = f"s{(k // origins) % max(1, sensors // origins):03d}"
        ts = start + timedelta(seconds=i * step + rng.random() * step)
        late = rng.random() < late_rate
        received = ts + timedelta(
            seconds=rng.uniform(60, late_max_s) if late else rng.uniform(0.1, 5)
        )
        value = round(rng.gauss(20, 5) * 16) / 16  # a DS18B20's 1/16 degree steps
        flags = ["clock_unsynced", "clock_corrected"] if rng.random() < 0.01 else []
        rec = {
            "id": f"{origin}/e{seed}/{k}",
            "origin": origin,
            "sensor": sensor,
            "ts": _iso(ts),
            "value": value,
            "unit": "C",
            "flags": flags,
            "gateway": origin,
            "received": _iso(received),
        }
        f = rng.randrange(files)
        out[f].append(json.dumps(rec, separators=(",", ":")))
        lines += 1
        if rng.random() < dup_rate:  # delivered again after a session loss, later
            again = {**rec, "received": _iso(received + timedelta(seconds=rng.uniform(1, 600)))}
            out[rng.randrange(files)].append(json.dumps(again, separators=(",", ":")))
            lines += 1
    day = start.strftime("%Y-%m-%d")
    d = Path(root) / f"date={day}"
    d.mkdir(parents=True, exist_ok=True)
    for j, chunk in enumerate(out):
        if chunk:
            (d / f"{name}-{seed}-{j}.jsonl").write_text("\n".join(chunk) + "\n")
    return lines
