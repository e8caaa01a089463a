"""Pulse counter: rain gauges, water flow meters, S0 energy meters.

Edges are counted in the backend's callback thread with a software debounce:
an edge of the counted polarity is accepted only if at least ``debounce_s``
has passed since the last accepted one, so a contact's bounce burst counts
once. (Backend bounce times are not used: gpiozero's mock pins ignore them and
RPi.GPIO's is unreliable.)

Every ``interval_s`` the driver reports three channels:
``{id}.count`` (scaled amount this interval), ``{id}.total`` (scaled running
total) and ``{id}.rate`` (scaled amount per hour).

The running total survives power cuts through ``start_pulses``: the gateway
passes the last committed total (in pulses) when it creates the driver, and
reads ``pulses_total`` back with each reading it commits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Annotated, Literal

from pydantic import Field

from .api import Driver, SensorReading, Sink
from .errors import SensorConfigError
from .pins import InputPin
from .registry import Need, Provided, SensorOptions, SensorType


class PulseCounter(Driver):
    def __init__(
        self,
        sensor: str,
        pin: InputPin,
        *,
        scale: float = 1.0,
        unit: str = "pulses",
        interval_s: float = 60.0,
        debounce_s: float = 0.01,
        edge: str = "falling",
        start_pulses: int = 0,
    ) -> None:
        super().__init__(sensor)
        if edge not in ("falling", "rising"):
            raise SensorConfigError("edge must be 'falling' or 'rising'")
        self.pin = pin
        self.scale, self.unit = scale, unit
        self.interval_s, self.debounce_s = interval_s, debounce_s
        self._level_counted = edge == "rising"
        self._lock = threading.Lock()
        self._last_accepted = -float("inf")
        self._pending = 0  # accepted pulses not yet reported
        self.pulses_total = start_pulses
        pin.on_edge(self._edge)

    def _edge(self, level: bool, t: float) -> None:
        if level != self._level_counted:
            return
        with self._lock:
            if t - self._last_accepted < self.debounce_s:
                self.counters["bounces_ignored"] += 1
                return
            self._last_accepted = t
            self._pending += 1

    def take(self) -> int:
        """Pulses accepted since the last call (moved into the running total)."""
        with self._lock:
            n, self._pending = self._pending, 0
            self.pulses_total += n
        return n

    def report(self, sink: Sink, elapsed_s: float) -> None:
        n = self.take()
        mono = time.monotonic()
        amount = n * self.scale
        rate = amount / elapsed_s * 3600 if elapsed_s > 0 else 0.0
        for suffix, value, unit, kind in (
            ("count", amount, self.unit, "counter"),
            ("total", self.pulses_total * self.scale, self.unit, "total"),
            ("rate", rate, f"{self.unit}/h", "gauge"),
        ):
            channel = f"{self.sensor}.{suffix}"
            sink.reading(SensorReading(channel, round(value, 6), unit, mono=mono, kind=kind))

    async def run(self, sink: Sink) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s - (time.monotonic() - last) % self.interval_s)
            now = time.monotonic()
            self.report(sink, now - last)
            last = now

    def saved_state(self) -> str:
        # Committed with each reading, so a restart resumes the total it reported.
        return str(self.pulses_total)


class PulseOptions(SensorOptions):
    type: Literal["pulse"]
    pin: Annotated[int, Field(ge=0, le=53)]
    pull: Literal["up", "down", "none"] = "up"
    edge: Literal["falling", "rising"] = "falling"
    debounce_s: Annotated[float, Field(ge=0)] = 0.01
    scale: float = 1.0
    unit: str = "pulses"
    interval_s: Annotated[float, Field(gt=0)] = 60.0
    # Only with `gpio: simulated` (demo, development): pulses a second to fake. The
    # gateway starts them on the simulated pin; the driver never sees it.
    simulated_rate_hz: Annotated[float, Field(ge=0)] = 0.5


def build(cfg: PulseOptions, provided: Provided) -> PulseCounter:
    assert provided.gpio is not None  # the registry refuses a GPIO type without a backend
    return PulseCounter(
        cfg.id,
        provided.gpio.input(cfg.pin, cfg.pull),
        scale=cfg.scale,
        unit=cfg.unit,
        interval_s=cfg.interval_s,
        debounce_s=cfg.debounce_s,
        edge=cfg.edge,
        start_pulses=int(provided.saved) if provided.saved else 0,
    )


SENSOR = SensorType(
    "pulse",
    PulseOptions,
    build,
    needs={Need.GPIO, Need.STATE},
    state_key="pulses_total",
    summary="pulse counter: rain gauge, water meter, S0 energy meter",
)
