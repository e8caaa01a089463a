"""The gateway's sensor drivers: built from the fleet file, supervised, fed into the intake.

Each configured sensor runs as its own task. A driver that raises is logged,
counted and restarted with backoff (the same driver object, so a pulse
counter keeps the pulses it has not reported yet); a driver that cannot even
be built (a missing serial adapter) is retried the same way. Nothing one
driver does stops another.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pubcomp.sensors.api import ClockFix, Driver, SensorFault, SensorReading
from pubcomp.sensors.pins import PinFactory
from pubcomp.sensors.pins.simulated import SIMULATED, SimulatedFactory
from pubcomp.sensors.registry import (
    NEED_OPTION,
    Need,
    Provided,
    SensorOptions,
    build_from,
    get,
)
from pubcomp.sync.backoff import Backoff
from pubcomp.sync.store import Reading

from .clock import ClockWatch
from .intake import Intake

log = logging.getLogger(__name__)

STABLE_S = 60.0  # a driver that ran this long starts its backoff afresh
RESTART_BASE_S = 1.0
RESTART_CAP_S = 300.0


def pulses_key(sensor: str) -> str:
    """Where a pulse counter's running total is kept in the store (Need.STATE)."""
    return get("pulse").saved_key(sensor)


@dataclass
class SensorStatus:
    type: str
    state: str = "starting"  # running, backoff
    readings: int = 0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts: int = 0
    last_error: str | None = None
    last: dict[str, tuple[float | None, str | None, str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "state": self.state,
            "readings": self.readings,
            "faults": sum(self.faults.values()),
            "fault_kinds": dict(self.faults),
            "restarts": self.restarts,
            "last_error": self.last_error,
            "last": {k: {"value": v, "unit": u, "ts": t} for k, (v, u, t) in self.last.items()},
        }


class IntakeSink:
    """A driver's sink: stamps each reading by the gateway clock and queues it for commit."""

    def __init__(
        self,
        intake: Intake,
        clock: ClockWatch,
        status: SensorStatus,
        on_clock: Callable[[ClockFix], None],
    ) -> None:
        # Not ``self.clock``: that is the sink's method a GPS hands its fixes to.
        self.watch, self.status, self.on_clock = clock, status, on_clock
        self.intake = intake
        self.driver: Driver | None = None
        self.simulated = False  # its pins are gpio: simulated's: every reading says so
        self.state_key: str | None = None  # its type needs saved state: kept here

    def reading(self, r: SensorReading) -> None:
        ts, flags = self.watch.stamp(r.mono)
        flags = (*flags, *r.flags)
        if self.simulated and SIMULATED not in flags:
            flags = (*flags, SIMULATED)
        self.intake.add(Reading(r.sensor, r.value, ts, r.unit, None, flags, kind=r.kind))
        self.status.readings += 1
        self.status.last[r.sensor] = (r.value, r.unit, ts)
        if self.state_key is not None and self.driver is not None:
            # Committed with this reading, so a restart resumes from what it reported.
            state = self.driver.saved_state()
            if state is not None:
                self.intake.set_state(self.state_key, state)

    def fault(self, f: SensorFault) -> None:
        self.status.faults[f.kind] += 1

    def clock(self, c: ClockFix) -> None:
        self.on_clock(c)


class Drivers:
    """Every configured sensor as a supervised task."""

    def __init__(
        self,
        sensors: list[SensorOptions],
        gpio: Callable[[], PinFactory],
        intake: Intake,
        clock: ClockWatch,
        on_clock: Callable[[ClockFix], None],
    ) -> None:
        self.sensors = sensors
        self._gpio_factory = gpio
        self._gpio: PinFactory | None = None
        self.intake, self.clock, self.on_clock = intake, clock, on_clock
        self.status: dict[str, SensorStatus] = {s.id: SensorStatus(s.type) for s in sensors}
        self.drivers: dict[str, Driver] = {}

    def tasks(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._supervise(s), name=f"sensor:{s.id}") for s in self.sensors
        ]

    def close(self) -> None:
        if self._gpio is not None:
            self._gpio.close()

    def _build(self, cfg: SensorOptions) -> Driver:
        """The driver for one entry, given what its type needs (sensors/registry.py)."""
        kind = get(cfg.type)
        gpio = None
        if Need.GPIO in kind.needs:
            if self._gpio is None:
                self._gpio = self._gpio_factory()
            gpio = self._gpio
        saved = None
        if Need.STATE in kind.needs:
            saved = self.intake.store.get_state(kind.saved_key(cfg.id))
        driver = build_from(cfg, Provided(gpio=gpio, saved=saved))
        # gpio: simulated (the demo): a type that can fake its input says how much.
        fake_rate = getattr(cfg, "simulated_rate_hz", 0)
        if isinstance(gpio, SimulatedFactory) and fake_rate:
            gpio.pins[getattr(cfg, NEED_OPTION[Need.GPIO])].pulse(fake_rate)
        return driver

    async def _supervise(self, cfg: SensorOptions) -> None:
        status = self.status[cfg.id]
        sink = IntakeSink(self.intake, self.clock, status, self.on_clock)
        kind = get(cfg.type)
        if Need.STATE in kind.needs:
            sink.state_key = kind.saved_key(cfg.id)
        backoff = Backoff(base=RESTART_BASE_S, cap=RESTART_CAP_S)
        while True:
            started = time.monotonic()
            try:
                driver = self.drivers.get(cfg.id)
                if driver is None:
                    driver = self.drivers[cfg.id] = self._build(cfg)
                sink.driver = driver
                sink.simulated = Need.GPIO in kind.needs and isinstance(
                    self._gpio, SimulatedFactory
                )
                status.state = "running"
                await driver.run(sink)
                raise RuntimeError("driver stopped on its own")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started > STABLE_S:
                    backoff.reset()
                delay = backoff.next_delay()
                status.restarts += 1
                status.last_error = f"{type(exc).__name__}: {exc}"
                status.state = "backoff"
                log.error(
                    "sensor %s failed (%s); restarting in %.1f s", cfg.id, status.last_error, delay
                )
                await asyncio.sleep(delay)
