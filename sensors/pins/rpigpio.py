"""RPi.GPIO backend: the classic library for Raspberry Pi 1-4 (it fails on a Pi 5)."""

from __future__ import annotations

import threading
import time
from types import ModuleType
from typing import Any

from ..errors import GPIOUnavailable, SensorConfigError
from . import PULLS, EdgeCallback


def _import_gpio() -> ModuleType:
    try:
        import RPi.GPIO as GPIO
    except (ImportError, RuntimeError) as exc:
        raise GPIOUnavailable(f"RPi.GPIO cannot be used here: {exc}") from exc
    return GPIO


class RPiGPIOPin:
    def __init__(self, gpio: Any, number: int, pull: str) -> None:
        self._gpio = gpio
        self.number = number
        pud = {"up": gpio.PUD_UP, "down": gpio.PUD_DOWN, "none": gpio.PUD_OFF}[pull]
        gpio.setup(number, gpio.IN, pull_up_down=pud)
        self._callbacks: list[EdgeCallback] = []
        self._lock = threading.Lock()

    def read(self) -> bool:
        return bool(self._gpio.input(self.number))

    def on_edge(self, callback: EdgeCallback) -> None:
        with self._lock:
            first = not self._callbacks
            self._callbacks.append(callback)
        if first:
            # No bouncetime: RPi.GPIO's is unreliable; drivers debounce in software.
            self._gpio.add_event_detect(self.number, self._gpio.BOTH, callback=self._edge)

    def _edge(self, channel: int) -> None:
        t = time.monotonic()
        level = bool(self._gpio.input(channel))
        for cb in self._callbacks:
            cb(level, t)

    def close(self) -> None:
        if self._callbacks:
            self._gpio.remove_event_detect(self.number)
        self._gpio.cleanup(self.number)


class RPiGPIOFactory:
    name = "rpigpio"

    def __init__(self, gpio_module: Any = None) -> None:
        self._gpio = gpio_module or _import_gpio()
        self._gpio.setwarnings(False)
        self._gpio.setmode(self._gpio.BCM)
        self._pins: list[RPiGPIOPin] = []

    def input(self, number: int, pull: str = "up") -> RPiGPIOPin:
        if pull not in PULLS:
            raise SensorConfigError(f"pull must be one of {PULLS}")
        try:
            pin = RPiGPIOPin(self._gpio, number, pull)
        except (RuntimeError, ValueError) as exc:
            raise GPIOUnavailable(f"GPIO{number}: {exc}") from exc
        self._pins.append(pin)
        return pin

    def close(self) -> None:
        for p in self._pins:
            p.close()
        self._pins.clear()
