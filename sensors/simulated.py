"""Simulated signals for the demo and development: sine, random walk, counter.

Every reading carries the flag ``simulated`` (docs/wire-format.md), so made-up
values can never pass for measurements downstream.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Annotated, Literal

from pydantic import Field

from .api import Driver, SensorReading, Sink
from .errors import SensorConfigError
from .pins.simulated import SIMULATED
from .registry import Provided, SensorOptions, SensorType

SIGNALS = ("sine", "random_walk", "counter")


class SimulatedSensor(Driver):
    def __init__(
        self,
        sensor: str,
        *,
        signal: str = "sine",
        unit: str | None = None,
        interval_s: float = 1.0,
        base: float = 20.0,
        amplitude: float = 5.0,
        period_s: float = 600.0,
        step: float = 0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(sensor)
        if signal not in SIGNALS:
            raise SensorConfigError(f"signal must be one of {SIGNALS}, not {signal!r}")
        self.signal, self.unit, self.interval_s = signal, unit, interval_s
        self.base, self.amplitude, self.period_s, self.step = base, amplitude, period_s, step
        self._rng = random.Random(seed)
        self._value = base
        self._n = 0

    def sample(self, t: float) -> float:
        self._n += 1
        if self.signal == "sine":
            return round(self.base + self.amplitude * math.sin(2 * math.pi * t / self.period_s), 4)
        if self.signal == "random_walk":
            self._value += self._rng.gauss(0, self.step)
            return round(self._value, 4)
        return float(self._n)

    async def run(self, sink: Sink) -> None:
        start = time.monotonic()
        while True:
            now = time.monotonic()
            value = self.sample(now - start)
            sink.reading(SensorReading(self.sensor, value, self.unit, mono=now, flags=(SIMULATED,)))
            await asyncio.sleep(self.interval_s)


class SimulatedOptions(SensorOptions):
    type: Literal["simulated"]
    signal: Literal["sine", "random_walk", "counter"] = "sine"
    unit: str | None = None
    interval_s: Annotated[float, Field(gt=0)] = 1.0
    base: float = 20.0
    amplitude: float = 5.0
    period_s: Annotated[float, Field(gt=0)] = 600.0
    step: float = 0.1
    seed: int | None = None


def build(cfg: SimulatedOptions, provided: Provided) -> SimulatedSensor:
    return SimulatedSensor(cfg.id, **cfg.model_dump(exclude={"id", "type"}))


SENSOR = SensorType(
    "simulated",
    SimulatedOptions,
    build,
    summary="made-up signals for the demo and development, flagged simulated",
)
