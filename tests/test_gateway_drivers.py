"""Supervised drivers: a crashing driver is restarted and reported, the others go on;
a pulse counter's total survives a restart through the store."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pubcomp.gateway import drivers as drivers_mod
from pubcomp.gateway.clock import ClockWatch
from pubcomp.gateway.config import GatewayConfig
from pubcomp.gateway.drivers import Drivers, pulses_key
from pubcomp.gateway.intake import Intake
from pubcomp.sensors.api import ClockFix, Driver, Sink
from pubcomp.sensors.pins.simulated import SimulatedFactory
from pubcomp.sync.store import Store
from tests.sensor_helpers import GGA, RMC, Pty


class Crashes(Driver):
    async def run(self, sink: Sink) -> None:
        await asyncio.sleep(0.01)
        raise OSError("adapter unplugged")


def _sensors(*entries: dict[str, Any]) -> list[Any]:
    cfg = GatewayConfig.model_validate(
        {"id": "g", "fleet": "f", "uplink": {"broker": "mqtt://h:1"}, "sensors": list(entries)}
    )
    return list(cfg.sensors)


async def _run_until(drivers: Drivers, intake: Intake, done: Callable[[], bool]) -> None:
    task = asyncio.create_task(intake.run())
    tasks = drivers.tasks()
    async with asyncio.timeout(60):
        while not done():
            await asyncio.sleep(0.05)
    await _stop(tasks, intake, task)


async def _stop(
    tasks: list[asyncio.Task[None]], intake: Intake, committing: asyncio.Task[None]
) -> None:
    """Stop the drivers, then the intake, which commits what they handed over."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    intake.close()
    await committing


def test_a_crashing_driver_is_restarted_and_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = drivers_mod.build_from

    def build_from(cfg: Any, provided: Any) -> Driver:
        return Crashes(cfg.id) if cfg.id == "bad" else real_build(cfg, provided)

    monkeypatch.setattr(drivers_mod, "build_from", build_from)
    monkeypatch.setattr(drivers_mod, "RESTART_BASE_S", 0.05)
    sensors = _sensors(
        {"id": "bad", "type": "simulated"},
        {"id": "good", "type": "simulated", "interval_s": 0.05},
    )
    with Store(tmp_path / "s.db", gateway_id="g") as store:
        intake = Intake(store)
        d = Drivers(sensors, SimulatedFactory, intake, ClockWatch(), lambda c: None)
        bad, good = d.status["bad"], d.status["good"]
        asyncio.run(_run_until(d, intake, lambda: bad.restarts >= 3 and good.readings >= 20))
        assert bad.restarts >= 3 and bad.last_error == "OSError: adapter unplugged"
        assert bad.readings == 0
        assert good.restarts == 0 and good.readings >= 20
        assert store.stats()["backlog"] == good.readings  # every good reading committed


def test_pulse_total_survives_a_restart(tmp_path: Path) -> None:
    sensors = _sensors(
        {"id": "rain", "type": "pulse", "pin": 5, "interval_s": 0.2, "simulated_rate_hz": 0}
    )
    factories: list[SimulatedFactory] = []

    def factory() -> SimulatedFactory:
        factories.append(SimulatedFactory())
        return factories[-1]

    async def run_with_pulses(store: Store, n: int, total: float) -> Drivers:
        """``n`` pulses, then wait until the driver has reported ``total``."""
        intake = Intake(store)
        d = Drivers(sensors, factory, intake, ClockWatch(), lambda c: None)
        task = asyncio.create_task(intake.run())
        made = len(factories)
        tasks = d.tasks()
        async with asyncio.timeout(30):
            while len(factories) == made or "rain" not in d.drivers:  # the driver is up
                await asyncio.sleep(0.01)
            pin = factories[-1].pins[5]
            for _ in range(n):  # falling edges, 20 ms apart: beyond the 10 ms debounce
                pin.drive(False)
                await asyncio.sleep(0.01)
                pin.drive(True)
                await asyncio.sleep(0.01)
            while d.status["rain"].last.get("rain.total", (None,))[0] != total:
                await asyncio.sleep(0.05)
        await _stop(tasks, intake, task)
        return d

    with Store(tmp_path / "s.db", gateway_id="g") as store:
        asyncio.run(run_with_pulses(store, 7, 7.0))
        assert store.get_state(pulses_key("rain")) == "7"
        d = asyncio.run(run_with_pulses(store, 5, 12.0))
        assert store.get_state(pulses_key("rain")) == "12"
        assert d.status["rain"].last["rain.total"][0] == 12.0


def test_made_up_readings_are_flagged_simulated_in_the_data(tmp_path: Path) -> None:
    """A simulated signal, and a pulse counter on simulated pins (gpio: simulated), put
    ``simulated`` in every reading's flags; the same counter on real pins does not (issue 25:
    fake pulses went to the cloud as measurements, with only a log line to say so)."""
    from gpiozero.pins.mock import MockFactory

    from pubcomp.sensors.pins.zero import GpiozeroFactory

    def flags(gpio: Callable[[], Any], *entries: dict[str, Any]) -> dict[str, set[str]]:
        with Store(tmp_path / f"s{len(list(tmp_path.iterdir()))}.db", gateway_id="g") as store:
            intake = Intake(store)
            d = Drivers(_sensors(*entries), gpio, intake, ClockWatch(lambda: True), lambda c: None)
            asyncio.run(
                _run_until(d, intake, lambda: all(s.readings >= 3 for s in d.status.values()))
            )
            rows = store.readings_between(1, store.given_seq())
        out: dict[str, set[str]] = {}
        for r in rows:
            out.setdefault(r["sensor"].split(".")[0], set()).add(",".join(r["flags"]))
        return out

    pulse = {"id": "rain", "type": "pulse", "pin": 5, "interval_s": 0.05}
    fake = flags(SimulatedFactory, {"id": "sig", "type": "simulated", "interval_s": 0.05}, pulse)
    assert fake == {"sig": {"simulated"}, "rain": {"simulated"}}
    real = flags(lambda: GpiozeroFactory(MockFactory()), pulse)
    assert real == {"rain": {""}}


def test_a_gps_on_the_gateway_hands_its_time_to_the_clock(tmp_path: Path) -> None:
    """An NMEA receiver configured on a gateway, over a real pseudo-terminal: its fixes
    reach the gateway's clock (the sink once shadowed its clock() method with the
    ClockWatch, so every fix raised TypeError and the driver restarted)."""
    gps = Pty(tmp_path / "ttyGPS")
    fixes: list[ClockFix] = []
    sensors = _sensors({"id": "gps", "type": "nmea", "port": str(gps.link), "interval_s": 0})

    async def main(store: Store) -> Drivers:
        intake = Intake(store)
        d = Drivers(sensors, SimulatedFactory, intake, ClockWatch(), fixes.append)
        committing = asyncio.create_task(intake.run())
        tasks = d.tasks()
        async with asyncio.timeout(30):
            while not fixes:  # a receiver repeats its sentences every second
                gps.write(GGA + RMC)
                await asyncio.sleep(0.1)
        await _stop(tasks, intake, committing)
        return d

    try:
        with Store(tmp_path / "s.db", gateway_id="g") as store:
            d = asyncio.run(main(store))
    finally:
        os.close(gps.master)
    assert fixes[0].utc == datetime(1994, 3, 23, 12, 35, 19, tzinfo=UTC)
    assert d.status["gps"].restarts == 0 and d.status["gps"].last_error is None
    assert d.status["gps"].readings > 0
