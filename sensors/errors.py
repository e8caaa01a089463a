"""Everything sensors/ raises on purpose, as one family, defined here and only here (in
the manner of httpx's ``_exceptions.py``)::

    SensorError              catch it to catch any of these
    ├── SensorConfigError    (also a ValueError) a sensor cannot be made as asked: an
    │                        unknown type, options its model refuses, a need nobody met
    │                        (a GPIO sensor without a GPIO backend), a type declared twice
    ├── GPIOUnavailable      (also a RuntimeError) a GPIO backend, or one of its pins,
    │                        cannot be used on this machine (sensors/pins/)
    └── ReadError            one reading failed; ``kind`` is the fault's name. The driver
        │                    catches it, reports it (``Driver.report_fault``: counted,
        │                    logged, handed to the sink) and goes on
        └── ProbeError       a 1-Wire probe's (onewire.py): crc_error, power_on_value,
                             vanished, read_error, bad_frame

Not raised, but met: ``OSError`` from a bus, a port or sysfs, and pyserial's
``SerialException``. A driver catches them, reports a fault (``port_error``,
``bus_error``) and reopens the device with back-off (backoff.py). What a driver reports
is a value, not an exception: ``SensorFault`` (api.py), and a serial parser's
``FrameError`` (frames.py).
"""

from __future__ import annotations


class SensorError(Exception):
    """Base of everything sensors/ raises on purpose (see the module docstring)."""


class SensorConfigError(SensorError, ValueError):
    """A sensor cannot be made as asked; the message says what to change."""


class GPIOUnavailable(SensorError, RuntimeError):
    """The backend's library or the pin cannot be used on this machine."""


class ReadError(SensorError):
    """One reading failed; the driver reports it as a fault of ``kind`` and goes on."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class ProbeError(ReadError):
    """A 1-Wire probe's reading failed (onewire.py)."""
