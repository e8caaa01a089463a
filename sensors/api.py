"""The interface between drivers and the gateway.

A driver is an object with ``async run(sink)``: it runs until cancelled and
calls the sink from the event loop's thread, never blocking it. The gateway's
intake is the sink (it stamps ids and commits to the store); ``pubcomp sensor
test`` prints to stdout; tests collect into lists.

- ``sink.reading(r)``: one value of one sensor channel.
- ``sink.fault(f)``: a broken frame, a bad checksum, a timeout, an unplugged
  adapter, a power-on value: counted, reported, and the driver goes on.
- ``sink.clock(c)``: a trusted UTC time from the sensor (GPS), so the gateway
  can use it as a clock source while NTP is absent.
"""

from __future__ import annotations

import abc
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class SensorReading:
    sensor: str  # the channel id, e.g. "rain.total"; the configured id plus a suffix
    value: float | None
    unit: str | None
    ts: str = field(default_factory=utc_now)  # UTC ISO 8601 with milliseconds
    flags: Sequence[str] = ()
    # Monotonic time of the reading, so the gateway can correct ts once time syncs.
    mono: float = field(default_factory=time.monotonic)
    # A level (gauge), a count since the last reading (counter) or a running total:
    # the rollups sum a counter and chart a total by its last value, not by a mean.
    kind: str = "gauge"

    def as_dict(self) -> dict[str, Any]:
        return {
            "sensor": self.sensor,
            "ts": self.ts,
            "value": self.value,
            "unit": self.unit,
            "flags": list(self.flags),
            "kind": self.kind,
        }


@dataclass(slots=True)
class SensorFault:
    sensor: str
    kind: str  # bad_checksum, bad_frame, timeout, port_error, crc_error, power_on_value, ...
    detail: str
    ts: str = field(default_factory=utc_now)

    def as_dict(self) -> dict[str, Any]:
        return {"sensor": self.sensor, "fault": self.kind, "detail": self.detail, "ts": self.ts}


@dataclass(slots=True)
class ClockFix:
    source: str  # e.g. "gps"
    utc: datetime
    mono: float = field(default_factory=time.monotonic)


class Sink(Protocol):
    def reading(self, r: SensorReading) -> None: ...
    def fault(self, f: SensorFault) -> None: ...
    def clock(self, c: ClockFix) -> None: ...


class BufferSink:
    """Collects everything in order; usable from a worker thread, then ``replay``ed."""

    def __init__(self) -> None:
        self.readings: list[SensorReading] = []
        self.faults: list[SensorFault] = []
        self.clocks: list[ClockFix] = []
        self._order: list[SensorReading | SensorFault | ClockFix] = []

    def reading(self, r: SensorReading) -> None:
        self.readings.append(r)
        self._order.append(r)

    def fault(self, f: SensorFault) -> None:
        self.faults.append(f)
        self._order.append(f)

    def clock(self, c: ClockFix) -> None:
        self.clocks.append(c)
        self._order.append(c)

    def replay(self, sink: Sink) -> None:
        for item in self._order:
            if isinstance(item, SensorReading):
                sink.reading(item)
            elif isinstance(item, SensorFault):
                sink.fault(item)
            else:
                sink.clock(item)


class Driver(abc.ABC):
    """Base of every driver: an id, counters, and ``run``."""

    def __init__(self, sensor: str) -> None:
        self.sensor = sensor
        self.counters: collections.Counter[str] = collections.Counter()

    @abc.abstractmethod
    async def run(self, sink: Sink) -> None:
        """Produce readings until cancelled."""

    def saved_state(self) -> str | None:
        """For a type that needs saved state (registry.Need.STATE): what the gateway commits
        with each of its readings and hands back (``Provided.saved``) when it builds the
        driver again, after a restart or a power cut. None: nothing to save."""
        return None

    def report_fault(self, sink: Sink, kind: str, detail: str) -> None:
        self.counters[kind] += 1
        log.warning("sensor %s: %s: %s", self.sensor, kind, detail)
        sink.fault(SensorFault(self.sensor, kind, detail))
