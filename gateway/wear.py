"""What the gateway costs its SD card: bytes written, fsyncs, and the card's projected life.

The bytes are the kernel's own count for this process (``write_bytes`` in
/proc/self/io: every page it dirtied that went, or will go, to the block
device), so they include SQLite's WAL and database pages, checkpoints and
logs alike. The fsyncs are the store's: one per commit (``synchronous=FULL``)
and two per checkpoint. The rate is taken over the last hour of samples (or
since start, if shorter), and the life is the card's rated endurance divided
by that rate: a projection at today's load, not a measurement of the card.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

WINDOW_S = 3600.0
WARN_YEARS = 5.0
DAY_S = 86400.0


def process_write_bytes(pid: int | str = "self") -> int | None:
    """Bytes the process caused to be written to storage; None where the kernel keeps no count."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Wear:
    def __init__(self, endurance_tbw: float, *, clock: Any = time.monotonic) -> None:
        self.endurance_bytes = endurance_tbw * 1e12
        self._clock = clock
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()
        self.start = self._sample_now(0)

    def _sample_now(self, fsyncs: int) -> tuple[float, int, int]:
        return (self._clock(), process_write_bytes() or 0, fsyncs)

    def sample(self, fsyncs: int) -> None:
        now = self._sample_now(fsyncs)
        self._samples.append(now)
        while len(self._samples) > 2 and now[0] - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()

    def figures(self, fsyncs: int) -> dict[str, Any]:
        t, written, _ = now = self._sample_now(fsyncs)
        t0, w0, f0 = self._samples[0] if self._samples else self.start
        span = t - t0
        per_day = (written - w0) / span * DAY_S if span >= 1.0 else None
        years = None
        if per_day:
            years = self.endurance_bytes / per_day / 365.0
        return {
            "bytes_written": now[1] - self.start[1],
            "fsyncs": fsyncs,
            "fsyncs_per_s": round((fsyncs - f0) / span, 2) if span >= 1.0 else None,
            "bytes_per_day": None if per_day is None else round(per_day),
            "endurance_tbw": self.endurance_bytes / 1e12,
            "life_years": None if years is None else round(years, 1),
            "life_warning": years is not None and years < WARN_YEARS,
        }
