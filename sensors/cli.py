"""``pubcomp sensor test``: read one sensor directly, for checking wiring in the field."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    sensor = sub.add_parser("sensor", help="sensor drivers")
    ssub = sensor.add_subparsers(dest="sensor_command", metavar="ACTION", required=True)
    t = ssub.add_parser(
        "test",
        help="read one sensor and print its readings as JSON lines",
        description="Reads one sensor without the store or the uplink. Readings go to "
        "stdout as JSON lines, faults (broken frames, bad checksums) to stderr.",
    )
    t.add_argument(
        "--type",
        required=True,
        dest="kind",
        help="pulse, digital, ds18b20, pms5003, sds011, nmea, modbus, simulated",
    )
    t.add_argument("--port", help="serial port or URL (serial sensors, modbus)")
    t.add_argument("--baud", type=int)
    t.add_argument("--pin", type=int, help="BCM GPIO number (pulse, digital)")
    t.add_argument("--gpio", default="auto", help="auto, rpigpio, gpiozero, simulated")
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
