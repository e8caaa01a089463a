"""DS18B20 temperature probes on the Linux 1-Wire bus (sysfs, ``dtoverlay=w1-gpio``).

Prefers each device's ``temperature`` file (millidegrees, newer kernels) and
falls back to ``w1_slave``. A CRC failure, the 85 °C power-on value and a
vanished device are reported as faults, never raised. The kernel's read takes
about 750 ms per probe, so reads run in a worker thread.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from .api import BufferSink, Driver, SensorReading, Sink
from .errors import ProbeError
from .registry import Provided, SensorOptions, SensorType

W1_DEVICES = Path("/sys/bus/w1/devices")
FAMILY = "28-"  # DS18B20
POWER_ON_MILLIDEGREES = 85000


def discover(base: Path = W1_DEVICES) -> list[str]:
    """Ids of every DS18B20 on the bus, sorted."""
    try:
        return sorted(p.name for p in base.iterdir() if p.name.startswith(FAMILY))
    except FileNotFoundError:
        return []


def read_millidegrees(device: Path) -> int:
    """One conversion from a device directory; raises ProbeError."""
    try:
        temp = device / "temperature"
        if temp.exists():
            text = temp.read_text().strip()
            if not text:
                raise ProbeError("crc_error", f"{device.name}: empty temperature (CRC failed)")
            value = int(text)
        else:
            lines = (device / "w1_slave").read_text().splitlines()
            if len(lines) < 2 or not lines[0].rstrip().endswith("YES"):
                raise ProbeError("crc_error", f"{device.name}: CRC check failed: {lines[:1]}")
            m = re.search(r"t=(-?\d+)", lines[1])
            if not m:
                raise ProbeError("bad_frame", f"{device.name}: no t= in {lines[1]!r}")
            value = int(m.group(1))
    except FileNotFoundError:
        raise ProbeError("vanished", f"{device.name}: device is gone from the bus") from None
    except (OSError, ValueError) as exc:
        raise ProbeError("read_error", f"{device.name}: {exc}") from None
    if value == POWER_ON_MILLIDEGREES:
        raise ProbeError("power_on_value", f"{device.name}: 85.000 C power-on value, not a reading")
    return value


class DS18B20(Driver):
    """All probes (or the listed ``devices``) on the bus, one channel per probe.

    The channel is ``{id}.{device}`` unless ``names`` maps a device id to a name.
    """

    def __init__(
        self,
        sensor: str,
        *,
        base: Path = W1_DEVICES,
        devices: list[str] | None = None,
        names: dict[str, str] | None = None,
        interval_s: float = 30.0,
    ) -> None:
        super().__init__(sensor)
        self.base, self.devices = Path(base), devices
        self.names = names or {}
        self.interval_s = interval_s

    def channel(self, device: str) -> str:
        return self.names.get(device) or f"{self.sensor}.{device}"

    def poll(self, sink: Sink) -> None:
        """One round over the bus (blocking: call it from a thread or a test)."""
        found = discover(self.base)
        wanted = self.devices if self.devices is not None else found
        for dev in wanted:
            mono = time.monotonic()
            try:
                if dev not in found:
                    raise ProbeError("vanished", f"{dev}: device is gone from the bus")
                mc = read_millidegrees(self.base / dev)
            except ProbeError as exc:
                self.report_fault(sink, exc.kind, str(exc))
                continue
            self.counters["readings"] += 1
            sink.reading(SensorReading(self.channel(dev), mc / 1000.0, "C", mono=mono))

    async def run(self, sink: Sink) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            buffer = BufferSink()
            await loop.run_in_executor(None, self.poll, buffer)
            buffer.replay(sink)  # back on the loop's thread
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))


class DS18B20Options(SensorOptions):
    type: Literal["ds18b20"]
    interval_s: Annotated[float, Field(gt=0)] = 30.0
    devices: list[str] | None = None
    names: dict[str, str] | None = None
    base: str | None = None  # the sysfs bus directory (tests); default W1_DEVICES


def build(cfg: DS18B20Options, provided: Provided) -> DS18B20:
    return DS18B20(
        cfg.id,
        base=Path(cfg.base) if cfg.base else W1_DEVICES,
        devices=cfg.devices,
        names=cfg.names,
        interval_s=cfg.interval_s,
    )


SENSOR = SensorType(
    "ds18b20",
    DS18B20Options,
    build,
    summary="DS18B20 1-Wire temperature probes (the kernel's w1 sysfs)",
)
