"""A sink for driver tests: collects what a driver sends and lets a test wait for it."""

from __future__ import annotations

import asyncio
from typing import Any

from pubcomp.sensors.api import BufferSink, ClockFix, SensorFault, SensorReading


class ListSink(BufferSink):
    """Collects everything, and lets a test wait for what it expects (event-loop only)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def reading(self, r: SensorReading) -> None:
        super().reading(r)
        self.changed.set()

    def fault(self, f: SensorFault) -> None:
        super().fault(f)
        self.changed.set()

    def clock(self, c: ClockFix) -> None:
        super().clock(c)
        self.changed.set()

    def values(self, sensor: str) -> list[float | None]:
        return [r.value for r in self.readings if r.sensor == sensor]

    def fault_kinds(self) -> list[str]:
        return [f.kind for f in self.faults]

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        """Wait until ``predicate(self)`` holds (checked whenever something arrives)."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                self.changed.clear()
                await self.changed.wait()
