"""Digital input: door contacts, PIR motion sensors, float switches.

A reading on every debounced change (the level must hold for ``debounce_s``)
and a heartbeat of the current state every ``heartbeat_s``. Values are 1.0 for
active and 0.0 for inactive; with ``active_low`` (a contact to ground with a
pull-up) a low level is active.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from pydantic import Field

from .api import Driver, SensorReading, Sink
from .pins import InputPin
from .registry import Need, Provided, SensorOptions, SensorType


class DigitalInput(Driver):
    def __init__(
        self,
        sensor: str,
        pin: InputPin,
        *,
        debounce_s: float = 0.05,
        heartbeat_s: float = 300.0,
        active_low: bool = True,
    ) -> None:
        super().__init__(sensor)
        self.pin = pin
        self.debounce_s, self.heartbeat_s = debounce_s, heartbeat_s
        self.active_low = active_low
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: Sink | None = None
        self._reported: bool | None = None
        self._check: asyncio.TimerHandle | None = None
        pin.on_edge(self._edge)

    def _value(self, level: bool) -> float:
        return float(level != self.active_low)

    def _edge(self, level: bool, t: float) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._schedule_check)

    def _schedule_check(self) -> None:
        # Every edge restarts the wait: only a level that holds for debounce_s counts.
        if self._check is not None:
            self._check.cancel()
            self.counters["bounces_ignored"] += 1
        assert self._loop is not None
        self._check = self._loop.call_later(self.debounce_s, self._settled)

    def _settled(self) -> None:
        self._check = None
        level = self.pin.read()
        if level != self._reported and self._sink is not None:
            self._reported = level
            self._sink.reading(SensorReading(self.sensor, self._value(level), None))

    async def run(self, sink: Sink) -> None:
        self._loop, self._sink = asyncio.get_running_loop(), sink
        self._reported = level = self.pin.read()
        sink.reading(SensorReading(self.sensor, self._value(level), None, flags=["initial"]))
        while True:
            await asyncio.sleep(self.heartbeat_s)
            level = self.pin.read()
            sink.reading(SensorReading(self.sensor, self._value(level), None, flags=["heartbeat"]))
            self._reported = level


class DigitalOptions(SensorOptions):
    type: Literal["digital"]
    pin: Annotated[int, Field(ge=0, le=53)]
    pull: Literal["up", "down", "none"] = "up"
    active_low: bool = True
    debounce_s: Annotated[float, Field(ge=0)] = 0.05
    heartbeat_s: Annotated[float, Field(gt=0)] = 300.0


def build(cfg: DigitalOptions, provided: Provided) -> DigitalInput:
    assert provided.gpio is not None  # the registry refuses a GPIO type without a backend
    return DigitalInput(
        cfg.id,
        provided.gpio.input(cfg.pin, cfg.pull),
        debounce_s=cfg.debounce_s,
        heartbeat_s=cfg.heartbeat_s,
        active_low=cfg.active_low,
    )


SENSOR = SensorType(
    "digital",
    DigitalOptions,
    build,
    needs={Need.GPIO},
    summary="digital input: door contact, PIR motion sensor, float switch",
)
