"""Sensor benchmarks: pulse counting on gpiozero's mock pins, and serial parser throughput.

Prints, in one run:
- pulse counter: edges/s pushed through gpiozero's MockFactory flat out with every pulse
  counted, CPU microseconds per 1,000 edges, and the ratio to a bare gpiozero callback
  that only increments an int (the floor any driver pays);
- parsers: frames/s for PMS5003 and NMEA (GGA+RMC), and NMEA against pynmea2 on the
  same sentences.
"""

from __future__ import annotations

import argparse
import sys
import time

import pynmea2
from gpiozero.pins.mock import MockFactory

from pubcomp.sensors import nmea, pms5003
from pubcomp.sensors.pins.zero import GpiozeroFactory
from pubcomp.sensors.pulse import PulseCounter

GGA = nmea.sentence("GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,")
RMC = nmea.sentence("GPRMC,123519,A,4807.038,N,01131.000,E,022.4,084.4,230394,003.1,W")


def pulse_cpu(pulses: int) -> tuple[float, float, int]:
    """(edges/s, CPU µs per 1000 edges, pulses counted) driving mock pins flat out."""
    mock = MockFactory()
    pin = GpiozeroFactory(pin_factory=mock).input(17, "up")
    counter = PulseCounter("bench", pin, debounce_s=0.0)
    mp = mock.pin(17)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(pulses):
        mp.drive_low()
        mp.drive_high()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return 2 * pulses / wall, cpu / (2 * pulses) * 1e9, counter.take()


def bare_gpiozero_cpu(pulses: int) -> float:
    """CPU µs per 1000 edges for gpiozero alone, with a callback that only counts."""
    mock = MockFactory()
    p = mock.pin(18)
    p.function, p.pull, p.edges = "input", "up", "both"

    class Count:
        n = 0

        def changed(self, ticks: float, state: int) -> None:
            self.n += 1

    c = Count()
    p.when_changed = c.changed
    c0 = time.process_time()
    for _ in range(pulses):
        p.drive_low()
        p.drive_high()
    return (time.process_time() - c0) / (2 * pulses) * 1e9


def parser_rate(parser_factory: object, stream: bytes, frames: int) -> float:
    parser = parser_factory()  # type: ignore[operator]
    chunk = 4096
    t0 = time.perf_counter()
    got = 0
    for i in range(0, len(stream), chunk):
        got += len(parser.feed(stream[i : i + chunk]))
    elapsed = time.perf_counter() - t0
    assert got == frames, (got, frames)
    return frames / elapsed


def pynmea2_rate(lines: list[str]) -> float:
    t0 = time.perf_counter()
    for ln in lines:
        msg = pynmea2.parse(ln)
        if msg.sentence_type == "GGA":
            _ = (msg.latitude, msg.longitude, msg.altitude, msg.num_sats)
        else:
            _ = msg.datetime
    return len(lines) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pulses", type=int, default=200_000)
    ap.add_argument("--frames", type=int, default=100_000)
    args = ap.parse_args()

    rate, cpu_per_edge_ns, counted = pulse_cpu(args.pulses)
    bare_ns = bare_gpiozero_cpu(args.pulses)
    assert counted == args.pulses
    print("pulse counter on gpiozero MockFactory")
    print(f"  flat out: {rate:,.0f} edges/s, every pulse counted ({counted:,})")
    print(
        f"  CPU per 1,000 edges: {cpu_per_edge_ns / 1000 * 1000:,.0f} us "
        f"(bare gpiozero callback: {bare_ns:,.0f} us; ratio {cpu_per_edge_ns / bare_ns:.2f})"
    )
    print(
        "  with a debounce of D seconds the highest countable rate is 1/D by design "
        "(10 ms: 100 Hz; rain gauges and S0 meters pulse below 20 Hz)"
    )

    pms_stream = b"".join(
        pms5003.encode_frame(i % 500, i % 500, i % 500) for i in range(args.frames)
    )
    nmea_lines = [GGA, RMC] * (args.frames // 2)
    nmea_stream = b"".join(nmea_lines)
    pms = parser_rate(pms5003.PMS5003Parser, pms_stream, args.frames)
    ours = parser_rate(nmea.NMEAParser, nmea_stream, len(nmea_lines))
    theirs = pynmea2_rate([ln.decode().strip() for ln in nmea_lines])
    print("serial parsers")
    print(f"  PMS5003: {pms:,.0f} frames/s")
    print(
        f"  NMEA GGA+RMC: {ours:,.0f} sentences/s; pynmea2 {theirs:,.0f}/s "
        f"(ratio {ours / theirs:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
