"""gpiozero backend (lgpio underneath by default): the one that works on a Raspberry Pi 5.

Tests pass gpiozero's own ``MockFactory`` as ``pin_factory``.
"""

from __future__ import annotations

from typing import Any

from ..errors import GPIOUnavailable, SensorConfigError
from . import PULLS, EdgeCallback


class GpiozeroPin:
    def __init__(self, pin: Any, number: int, pull: str) -> None:
        self._pin = pin
        self.number = number
        pin.function = "input"
        pin.pull = {"up": "up", "down": "down", "none": "floating"}[pull]
        pin.edges = "both"
        self._callbacks: list[EdgeCallback] = []

    def read(self) -> bool:
        return bool(self._pin.state)

    def on_edge(self, callback: EdgeCallback) -> None:
        self._callbacks.append(callback)
        # gpiozero keeps only a weak reference: a bound method of this object, which
        # the driver holds, stays alive as long as the pin does.
        self._pin.when_changed = self._changed

    def _changed(self, ticks: float, state: int) -> None:
        for cb in self._callbacks:
            cb(bool(state), float(ticks))

    def close(self) -> None:
        self._pin.when_changed = None
        self._pin.close()


class GpiozeroFactory:
    name = "gpiozero"

    def __init__(self, pin_factory: Any = None) -> None:
        if pin_factory is None:
            try:
                from gpiozero import Device
            except ImportError as exc:
                raise GPIOUnavailable(f"gpiozero is not installed: {exc}") from exc
            pin_factory = Device.pin_factory  # one set up by the application, if any
        if pin_factory is None:
            try:
                from gpiozero.pins.lgpio import LGPIOFactory
            except ImportError as exc:
                raise GPIOUnavailable(f"gpiozero/lgpio are not installed: {exc}") from exc
            try:
                pin_factory = LGPIOFactory()
            except Exception as exc:  # lgpio: "can not open gpiochip" off a Pi
                raise GPIOUnavailable(f"gpiozero cannot open the GPIO chip: {exc}") from exc
        self._factory = pin_factory
        self._pins: list[GpiozeroPin] = []

    def input(self, number: int, pull: str = "up") -> GpiozeroPin:
        if pull not in PULLS:
            raise SensorConfigError(f"pull must be one of {PULLS}")
        try:
            pin = GpiozeroPin(self._factory.pin(number), number, pull)
        except Exception as exc:
            raise GPIOUnavailable(f"GPIO{number}: {exc}") from exc
        self._pins.append(pin)
        return pin

    def close(self) -> None:
        for p in self._pins:
            p.close()
        self._pins.clear()
