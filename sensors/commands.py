"""What ``pubcomp sensor test`` does (imported only when it runs)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

import serial

from .api import ClockFix, SensorFault, SensorReading
from .pins import GPIOUnavailable, make_factory
from .registry import GPIO_TYPES, SERIAL_TYPES, build


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


def sensor_test(args: argparse.Namespace) -> int:
    opts: dict[str, Any] = {}
    for kv in args.option:
        key, eq, val = kv.partition("=")
        if not eq:
            print(f"pubcomp sensor test: --option {kv!r} is not KEY=VALUE", file=sys.stderr)
            return 2
        opts[key.replace("-", "_")] = _value(val)
    if args.interval is not None:
        opts["interval_s"] = args.interval
    gpio = None
    try:
        if args.kind in GPIO_TYPES:
            if args.pin is None:
                raise ValueError(f"--pin is needed for a {args.kind} sensor")
            opts["pin"] = args.pin
            gpio = make_factory(args.gpio)
        if args.kind in SERIAL_TYPES or args.kind == "modbus":
            if not args.port:
                raise ValueError(f"--port is needed for a {args.kind} sensor")
            opts["port"] = args.port
            if args.baud:
                opts["baud"] = args.baud
            # Open it once now, so a wrong port fails here with the OS's reason.
            serial.serial_for_url(args.port, do_not_open=False).close()
        driver = build(args.kind, args.kind, opts, gpio)
    except (ValueError, TypeError, GPIOUnavailable, serial.SerialException, OSError) as exc:
        print(f"pubcomp sensor test: {exc}", file=sys.stderr)
        return 1
    if gpio is not None and gpio.name == "simulated" and args.kind == "pulse":
        gpio.pins[args.pin].pulse(5.0)  # type: ignore[attr-defined]
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
