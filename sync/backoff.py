"""How long to wait before trying again: exponential back-off with full jitter (the AWS
architecture blog's variant), for anything that reconnects or restarts: the uplink and
the ingest's connections (sync/running.py ``reconnecting``), the gateway's sensor
drivers and status link. sensors/serialport.py keeps its own (sensors/ imports nothing
of sync/)."""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with full jitter: ``next_delay()`` is uniform in
    ``[0, min(cap, base * 2**attempt))``; ``reset()`` once the thing works again."""

    def __init__(self, base: float = 0.2, cap: float = 30.0, rng: random.Random | None = None):
        self.base, self.cap = base, cap
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        delay = self._rng.uniform(0, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
