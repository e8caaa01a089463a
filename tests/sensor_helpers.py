"""Driver test helpers: a sink that collects what a driver sends and lets a test wait for
it, and a real pseudo-terminal standing in for a serial adapter."""

from __future__ import annotations

import asyncio
import os
import tty
from pathlib import Path
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


# Real sentences (the NMEA reference examples, with their published checksums).
GGA = b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47\r\n"
RMC = b"$GPRMC,123519,A,4807.038,N,01131.000,E,022.4,084.4,230394,003.1,W*6A\r\n"


class Pty:
    """A pseudo-terminal whose slave is reached through a symlink, like /dev/serial/by-id."""

    def __init__(self, link: Path) -> None:
        self.link = link
        self.master = -1
        self.plug()

    def plug(self) -> None:
        self.master, slave = os.openpty()
        tty.setraw(self.master)
        name = os.ttyname(slave)
        os.close(slave)
        tmp = self.link.with_suffix(".new")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(name)
        tmp.replace(self.link)

    def unplug(self) -> None:
        os.close(self.master)
        self.master = -1

    def write(self, data: bytes) -> None:
        os.write(self.master, data)
