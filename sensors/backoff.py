"""How long a driver waits before it reopens a device that failed (a serial port, an I2C
bus, a Modbus link).

Exponential, with half jitter: somewhere between ``d / 2`` and ``d``, where
``d = min(cap, base * 2**attempt)``. The jitter keeps sensors that failed together (a
USB hub that lost power) from all reopening at the same instant; the lower half is
never used, so the wait still grows. sensors/ keeps its own (it imports nothing of
sync/); the gateway restarts a crashed driver with sync's ``Backoff`` (full jitter).
"""

from __future__ import annotations

import random


def reopen_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before reopen number ``attempt`` (0 for the first)."""
    delay = min(cap, base * 2 ** min(attempt, 62))  # 2**attempt stays an int, never inf
    return (rng or random).uniform(delay / 2, delay)
