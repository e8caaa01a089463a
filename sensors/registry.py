"""Build a driver from a type name and its options (the fleet YAML's sensor entries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .api import Driver
from .pins import PinFactory

SERIAL_TYPES = {"pms5003": 9600, "sds011": 9600, "nmea": 9600}
GPIO_TYPES = ("pulse", "digital")
TYPES = (*GPIO_TYPES, "ds18b20", *SERIAL_TYPES, "modbus", "simulated")


def build(
    kind: str, sensor: str, options: dict[str, Any], gpio: PinFactory | None = None
) -> Driver:
    opts = dict(options)
    if kind in GPIO_TYPES:
        if gpio is None:
            raise ValueError(f"sensor {sensor}: type {kind} needs a GPIO backend")
        pin = gpio.input(int(opts.pop("pin")), opts.pop("pull", "up"))
        if kind == "pulse":
            from .pulse import PulseCounter

            return PulseCounter(sensor, pin, **opts)
        from .digital import DigitalInput

        return DigitalInput(sensor, pin, **opts)
    if kind == "ds18b20":
        from .onewire import DS18B20

        if "base" in opts:
            opts["base"] = Path(opts["base"])
        return DS18B20(sensor, **opts)
    if kind in SERIAL_TYPES:
        from .serialport import SerialPort
        from .serialsensor import SerialSensor

        port = SerialPort(opts.pop("port"), int(opts.pop("baud", SERIAL_TYPES[kind])))
        if kind == "pms5003":
            from .pms5003 import PMS5003Parser as parser
        elif kind == "sds011":
            from .sds011 import SDS011Parser as parser  # type: ignore[assignment]
        else:
            from .nmea import NMEAParser as parser  # type: ignore[assignment]

            opts.setdefault("clock_source", "gps")
        return SerialSensor(sensor, port, parser, **opts)
    if kind == "modbus":
        from .modbus import ModbusReader

        return ModbusReader(sensor, **opts)
    if kind == "simulated":
        from .simulated import SimulatedSensor

        return SimulatedSensor(sensor, **opts)
    raise ValueError(f"unknown sensor type {kind!r}; one of {', '.join(TYPES)}")
