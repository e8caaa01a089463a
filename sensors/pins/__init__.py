"""GPIO backends behind one small interface: a digital input with edge callbacks.

``make_factory(name)`` returns a backend: ``rpigpio`` (RPi.GPIO, Pi 1-4),
``gpiozero`` (gpiozero over lgpio, the one that works on a Pi 5), ``simulated``
(demo, laptops), or ``auto``. Hardware libraries are imported only when their
backend is created.

``auto`` does what gpiozero does with its pin factories: it tries the real
backends, the board's best first (``/proc/device-tree/model``: gpiozero on a
Pi 5, a Compute Module 5 or a Pi 500, RPi.GPIO first on older boards, both in
turn when the model cannot be read), and fails loudly when none loads. It
never picks ``simulated``: until issue 25 a container that masked the model
file got fake pins, and ``simulated_rate_hz`` then made up pulses that went to
the cloud as readings. Simulated pins come only from ``gpio: simulated``, and
the gateway flags their readings ``simulated``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

# GPIOUnavailable is defined with the rest of sensors/'s errors; importable from here too.
from ..errors import GPIOUnavailable as GPIOUnavailable
from ..errors import SensorConfigError

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


# The RP1 boards, whose GPIO RPi.GPIO cannot drive: "Raspberry Pi 5 Model B", "Raspberry
# Pi 500", "Raspberry Pi Compute Module 5" (and its Lite).
_PI5 = re.compile(r"Raspberry Pi (Compute Module )?5")


def detect(model_path: str | Path = "/proc/device-tree/model") -> tuple[tuple[str, ...], str]:
    """(the real backends to try, best first; why) for this board."""
    try:
        model = Path(model_path).read_bytes().rstrip(b"\x00").decode(errors="replace")
    except OSError as exc:
        # A container on a Pi may mask it: that is no reason to fake the pins.
        why = f"cannot read {model_path} ({exc.strerror})"
        return ("gpiozero", "rpigpio"), why
    if _PI5.search(model):
        return ("gpiozero",), f"{model}: RPi.GPIO cannot drive it, gpiozero with lgpio"
    if "Raspberry Pi" in model:
        return ("rpigpio", "gpiozero"), f"{model}: RPi.GPIO, else gpiozero"
    return ("gpiozero", "rpigpio"), f"{model}: not a Raspberry Pi model we know"


def auto(model_path: str | Path = "/proc/device-tree/model", **kwargs: Any) -> PinFactory:
    """The first real backend that loads on this board; GPIOUnavailable if none does."""
    order, why = detect(model_path)
    failures = []
    for name in order:
        try:
            factory = make_factory(name, **kwargs)
        except GPIOUnavailable as exc:
            failures.append(f"{name}: {exc}")
            continue
        log.warning("gpio: auto picked %s (%s)", name, why)
        return factory
    raise GPIOUnavailable(
        f"gpio: auto found no GPIO backend that loads ({why}; {'; '.join(failures)}). "
        "On a Raspberry Pi install pubcomp[pi]; without GPIO hardware set gpio: simulated "
        "(fake pins, their readings flagged simulated)"
    )


def make_factory(name: str, **kwargs: Any) -> PinFactory:
    if name == "auto":
        return auto(kwargs.pop("model_path", "/proc/device-tree/model"), **kwargs)
    if name == "rpigpio":
        from .rpigpio import RPiGPIOFactory

        return RPiGPIOFactory(**kwargs)
    if name == "gpiozero":
        from .zero import GpiozeroFactory

        return GpiozeroFactory(**kwargs)
    if name == "simulated":
        from .simulated import SimulatedFactory

        return SimulatedFactory(**kwargs)
    raise SensorConfigError(f"unknown gpio backend {name!r}; one of {BACKENDS}")
