"""GPIO backends behind one small interface: a digital input with edge callbacks.

``make_factory(name)`` returns a backend: ``rpigpio`` (RPi.GPIO, Pi 1-4),
``gpiozero`` (gpiozero over lgpio, the one that works on a Pi 5), ``simulated``
(demo, laptops), or ``auto`` (by ``/proc/device-tree/model``). Hardware
libraries are imported only when their backend is created.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

EdgeCallback = Callable[[bool, float], None]  # (level, seconds on a monotonic clock)
PULLS = ("up", "down", "none")
BACKENDS = ("auto", "rpigpio", "gpiozero", "simulated")


class InputPin(Protocol):
    number: int

    def read(self) -> bool: ...

    def on_edge(self, callback: EdgeCallback) -> None:
        """Call ``callback(level, t)`` on every change, from any thread."""

    def close(self) -> None: ...


class PinFactory(Protocol):
    name: str

    def input(self, number: int, pull: str = "up") -> InputPin: ...

    def close(self) -> None: ...


class GPIOUnavailable(RuntimeError):
    """The backend's library or the pin cannot be used on this machine."""


def detect(model_path: str | Path = "/proc/device-tree/model") -> tuple[str, str]:
    """(backend, why) for this board."""
    try:
        model = Path(model_path).read_bytes().rstrip(b"\x00").decode(errors="replace")
    except OSError:
        return "simulated", f"no {model_path}: not a Raspberry Pi"
    if "Raspberry Pi 5" in model:
        return "gpiozero", f"{model}: RPi.GPIO cannot drive a Pi 5, using gpiozero with lgpio"
    if "Raspberry Pi" in model:
        return "rpigpio", f"{model}: using RPi.GPIO"
    return "simulated", f"{model}: not a Raspberry Pi"


def make_factory(name: str, **kwargs: Any) -> PinFactory:
    if name == "auto":
        name, why = detect(kwargs.pop("model_path", "/proc/device-tree/model"))
        log.warning("gpio: auto picked %s (%s)", name, why)
    if name == "rpigpio":
        from .rpigpio import RPiGPIOFactory

        return RPiGPIOFactory(**kwargs)
    if name == "gpiozero":
        from .zero import GpiozeroFactory

        return GpiozeroFactory(**kwargs)
    if name == "simulated":
        from .simulated import SimulatedFactory

        return SimulatedFactory(**kwargs)
    raise ValueError(f"unknown gpio backend {name!r}; one of {BACKENDS}")
