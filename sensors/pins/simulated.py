"""Simulated pins for the demo and for development away from a Pi.

A pin can be driven by hand (``drive``) or made to pulse at a rate (a rain
gauge, a water meter) from a background thread. Only ``gpio: simulated`` gives
these (``auto`` never does), and the gateway flags what drivers read from them
``simulated`` (``SIMULATED``): fake data must say so in the data.
"""

from __future__ import annotations

import random
import threading
import time

from ..errors import SensorConfigError
from . import PULLS, EdgeCallback

SIMULATED = "simulated"  # the reading flag (docs/wire-format.md)


class SimulatedPin:
    def __init__(self, number: int, pull: str) -> None:
        self.number = number
        self._level = pull == "up"
        self._callbacks: list[EdgeCallback] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> bool:
        return self._level

    def on_edge(self, callback: EdgeCallback) -> None:
        self._callbacks.append(callback)

    def drive(self, level: bool, t: float | None = None) -> None:
        if level == self._level:
            return
        self._level = level
        t = time.monotonic() if t is None else t
        for cb in self._callbacks:
            cb(level, t)

    def pulse(self, rate_hz: float, width_s: float = 0.02, seed: int | None = None) -> None:
        """Pulse low (active-low contact) about ``rate_hz`` times a second."""
        rng = random.Random(seed)

        def loop() -> None:
            while not self._stop.wait(rng.expovariate(rate_hz)):
                self.drive(not self._level)
                if self._stop.wait(width_s):
                    break
                self.drive(not self._level)

        self._thread = threading.Thread(target=loop, name=f"sim-gpio{self.number}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(1)


class SimulatedFactory:
    name = "simulated"
    simulated = True  # what reads its pins is not a measurement

    def __init__(self) -> None:
        self.pins: dict[int, SimulatedPin] = {}

    def input(self, number: int, pull: str = "up") -> SimulatedPin:
        if pull not in PULLS:
            raise SensorConfigError(f"pull must be one of {PULLS}")
        pin = self.pins.get(number) or SimulatedPin(number, pull)
        self.pins[number] = pin
        return pin

    def close(self) -> None:
        for p in self.pins.values():
            p.close()
