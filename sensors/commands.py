"""What ``pubcomp sensor test`` does (imported only when it runs)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import Any

import serial

from .api import ClockFix, SensorFault, SensorReading
from .errors import SensorConfigError, SensorError
from .pins import make_factory
from .pins.simulated import SimulatedFactory
from .registry import Need, Provided, SensorType, build_from, get


class PrintSink:
    def __init__(self, count: int) -> None:
        self.count = count
        self.seen = 0
        self.done = asyncio.Event()

    def reading(self, r: SensorReading) -> None:
        if self.seen < self.count:
            print(json.dumps(r.as_dict()), flush=True)
            self.seen += 1
        if self.seen >= self.count:
            self.done.set()

    def fault(self, f: SensorFault) -> None:
        print(f"fault: {f.sensor}: {f.kind}: {f.detail}", file=sys.stderr, flush=True)

    def clock(self, c: ClockFix) -> None:
        print(f"clock: {c.source} says {c.utc.isoformat()}", file=sys.stderr, flush=True)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _options(args: argparse.Namespace, kind: SensorType[Any]) -> dict[str, Any]:
    """The options from the flags: --option, --interval, and what the type needs."""
    opts: dict[str, Any] = {}
    for kv in args.option:
        key, eq, val = kv.partition("=")
        if not eq:
            raise _Usage(f"--option {kv!r} is not KEY=VALUE")  # exit 2, as argparse
        opts[key.replace("-", "_")] = _value(val)
    if args.interval is not None:
        opts["interval_s"] = args.interval
    if Need.GPIO in kind.needs:
        if args.pin is None:
            raise SensorConfigError(f"--pin is needed for a {args.kind} sensor")
        opts["pin"] = args.pin
    if Need.SERIAL in kind.needs:
        if not args.port:
            raise SensorConfigError(f"--port is needed for a {args.kind} sensor")
        opts["port"] = args.port
        if args.baud:
            opts["baud"] = args.baud
    if Need.I2C in kind.needs:
        if args.bus is not None:
            opts["bus"] = args.bus
        if args.address is not None:
            opts["address"] = args.address
    return opts


class _Usage(Exception):
    """A malformed flag."""


def _i2c_device(bus: int | str) -> str:
    return f"/dev/i2c-{bus}" if isinstance(bus, int) else bus


def sensor_test(args: argparse.Namespace) -> int:
    gpio = None
    try:
        kind = get(args.kind)
        cfg: Any = kind.parse({**_options(args, kind), "id": args.kind, "type": args.kind})
        # Open what it needs once now, so a wrong port or bus fails here with the OS's reason.
        if Need.SERIAL in kind.needs:
            serial.serial_for_url(cfg.port, do_not_open=False).close()
        if Need.I2C in kind.needs:
            os.close(os.open(_i2c_device(cfg.bus), os.O_RDWR))
        if Need.GPIO in kind.needs:
            gpio = make_factory(args.gpio)
        driver = build_from(cfg, Provided(gpio=gpio))
    except _Usage as exc:
        print(f"pubcomp sensor test: {exc}", file=sys.stderr)
        return 2
    except (SensorError, ValueError, serial.SerialException, OSError) as exc:
        print(f"pubcomp sensor test: {exc}", file=sys.stderr)
        if gpio is not None:
            gpio.close()
        return 1
    if isinstance(gpio, SimulatedFactory) and "simulated_rate_hz" in kind.options.model_fields:
        gpio.pins[args.pin].pulse(5.0)  # fake pins: something to count
    sink = PrintSink(args.count)

    async def main() -> int:
        task = asyncio.create_task(driver.run(sink))
        try:
            await asyncio.wait_for(sink.done.wait(), args.timeout)
            return 0
        except TimeoutError:
            print(
                f"pubcomp sensor test: only {sink.seen} of {args.count} readings "
                f"in {args.timeout:.0f} s",
                file=sys.stderr,
            )
            return 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        return asyncio.run(main())
    finally:
        if gpio is not None:
            gpio.close()
