"""``pubcomp sensor test``: read one sensor directly, for checking wiring in the field."""

from __future__ import annotations

import argparse
from typing import Any


class _TestParser(argparse.ArgumentParser):
    """Its help lists the sensor types from the registry, found only when the help is
    shown: every ``pubcomp`` command builds this parser, and finding the types imports
    every driver module."""

    def format_help(self) -> str:
        from .registry import NEED_OPTION, sensor_types

        rows = []
        for name, kind in sensor_types().items():
            flags = " ".join(f"--{NEED_OPTION[n]}" for n in sorted(kind.needs) if n in NEED_OPTION)
            rows.append(f"  {name:<10} {flags:<7} {kind.summary}")
        self.epilog = "sensor types (--type), with the option each needs:\n" + "\n".join(rows)
        return super().format_help()


def register(sub: Any) -> None:
    sensor = sub.add_parser("sensor", help="sensor drivers")
    ssub = sensor.add_subparsers(
        dest="sensor_command", metavar="ACTION", required=True, parser_class=_TestParser
    )
    t = ssub.add_parser(
        "test",
        help="read one sensor and print its readings as JSON lines",
        description="Reads one sensor without the store or the uplink. Readings go to stdout\n"
        "as JSON lines, faults (broken frames, bad checksums) to stderr.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--type", required=True, dest="kind", help="the sensor type (listed below)")
    t.add_argument("--port", help="serial port or URL (serial sensors, modbus)")
    t.add_argument("--baud", type=int)
    t.add_argument("--pin", type=int, help="BCM GPIO number (GPIO sensors)")
    t.add_argument("--gpio", default="auto", help="auto, rpigpio, gpiozero, simulated")
    t.add_argument("--bus", type=int, help="I2C bus number: /dev/i2c-N (default 1)")
    t.add_argument(
        "--address", type=lambda s: int(s, 0), help="I2C address, e.g. 0x45 (default: the type's)"
    )
    t.add_argument("--count", type=int, default=10, help="stop after this many readings")
    t.add_argument("--interval", type=float, help="seconds between reports")
    t.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    t.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other driver option (repeatable), e.g. --option scale=0.2794",
    )
    t.set_defaults(handler=f"{__package__}.commands:sensor_test")
