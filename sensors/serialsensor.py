"""The driver loop shared by serial sensors: read, parse, report, reopen on loss.

Every frame error is reported and counted; a port that goes quiet for
``silence_s`` is reported once per quiet period as a ``timeout``; an unplugged
adapter is reported as a ``port_error`` and reopened with backoff. With
``interval_s`` > 0 only the latest frame of each interval is reported, so a
1 Hz sensor does not flood the store; clock fixes always pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Protocol, TypeVar

import serial
from pydantic import Field

from .api import ClockFix, Driver, SensorReading, Sink
from .frames import Frame, FrameError
from .registry import Need, Provided, SensorOptions, SensorType
from .serialport import SerialPort


class Parser(Protocol):
    def feed(self, data: bytes) -> list[Frame | FrameError]: ...


class SerialSensor(Driver):
    def __init__(
        self,
        sensor: str,
        port: SerialPort,
        parser_factory: Callable[[], Parser],
        *,
        interval_s: float = 0.0,
        silence_s: float = 10.0,
        clock_source: str | None = None,
    ) -> None:
        super().__init__(sensor)
        self.port = port
        self.parser_factory = parser_factory
        self.parser = parser_factory()
        self.interval_s, self.silence_s = interval_s, silence_s
        self.clock_source = clock_source
        self._latest: dict[str, tuple[float | None, str | None, float]] = {}
        self._last_report = 0.0

    async def run(self, sink: Sink) -> None:
        attempt = 0
        last_data = time.monotonic()
        try:
            while True:
                try:
                    data = await self.port.read()
                except serial.SerialException as exc:
                    self.report_fault(sink, "port_error", f"{self.port.url}: {exc}")
                    self.parser = self.parser_factory()  # a half frame died with the port
                    await self.port.wait_reopen(attempt)
                    attempt += 1
                    continue
                if attempt:
                    self.counters["reopened"] += 1
                    attempt = 0
                now = time.monotonic()
                if not data:
                    if now - last_data > self.silence_s:
                        self.report_fault(
                            sink, "timeout", f"{self.port.url}: no data for {self.silence_s:.0f} s"
                        )
                        last_data = now
                    continue
                last_data = now
                for item in self.parser.feed(data):
                    if isinstance(item, FrameError):
                        self.report_fault(sink, item.kind, item.detail)
                    else:
                        self.counters["frames"] += 1
                        self._frame(sink, item, now)
        finally:
            self.port.close()

    def _frame(self, sink: Sink, frame: Frame, now: float) -> None:
        if frame.utc is not None and self.clock_source:
            sink.clock(ClockFix(self.clock_source, frame.utc, now))
        for suffix, (value, unit) in frame.values.items():
            self._latest[suffix] = (value, unit, now)
        if self.interval_s and now - self._last_report < self.interval_s:
            return
        self._last_report = now
        for suffix, (value, unit, mono) in self._latest.items():
            sink.reading(SensorReading(f"{self.sensor}.{suffix}", value, unit, mono=mono))
        self._latest.clear()


class SerialOptions(SensorOptions):
    """What every serial sensor takes; its module adds ``type: Literal["its name"]``."""

    port: str  # anything serial_for_url opens: /dev/serial0, /dev/ttyUSB0, socket://...
    baud: int | None = None  # default: the sensor type's
    interval_s: Annotated[float, Field(ge=0)] = 60.0
    silence_s: Annotated[float, Field(gt=0)] = 10.0


S = TypeVar("S", bound=SerialOptions)


def serial_type(
    name: str,
    options: type[S],
    parser: Callable[[], Parser],
    *,
    summary: str,
    baud: int = 9600,
    clock_source: str | None = None,
) -> SensorType[S]:
    """The declaration of a serial sensor type: a frame parser behind ``SerialSensor``."""

    def build(cfg: S, provided: Provided) -> SerialSensor:
        return SerialSensor(
            cfg.id,
            SerialPort(cfg.port, cfg.baud or baud),
            parser,
            interval_s=cfg.interval_s,
            silence_s=cfg.silence_s,
            clock_source=clock_source,
        )

    return SensorType(name, options, build, needs={Need.SERIAL}, summary=summary)
