"""Serial sensors through real pseudo-terminals: junk, split frames, bad checksums, a silent
port, and unplug/replug. Frames are built from the datasheets with their checksums."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path

import pynmea2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pubcomp.sensors import nmea, pms5003, sds011
from pubcomp.sensors.frames import Frame, FrameError
from pubcomp.sensors.serialport import SerialPort
from pubcomp.sensors.serialsensor import SerialSensor
from tests.sensor_helpers import GGA, RMC, ListSink, Pty

# Real sentences (the NMEA reference examples, with their published checksums).
GSV = b"$GPGSV,2,1,08,01,40,083,46,02,17,308,41,12,07,344,39,14,22,228,45*75\r\n"


@pytest.fixture
def pty_port(tmp_path: Path) -> Pty:
    p = Pty(tmp_path / "ttyUSB0")
    yield p
    if p.master >= 0:
        os.close(p.master)


def run_driver(driver: SerialSensor, steps: object, until: object, timeout: float = 10) -> ListSink:
    """Run the driver while ``steps(sink)`` (a coroutine function) feeds the port."""

    async def main() -> ListSink:
        sink = ListSink()
        task = asyncio.create_task(driver.run(sink))
        try:
            # pyserial flushes the input when it opens a port: feed it only once open.
            async with asyncio.timeout(5):
                while not driver.port.is_open:
                    await asyncio.sleep(0.005)
            await steps(sink)  # type: ignore[operator]
            await sink.wait_for(until, timeout)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return sink

    return asyncio.run(main())


# ------------------------------------------------------------------ PMS5003


def test_pms5003_frame_layout_from_the_datasheet() -> None:
    f = pms5003.encode_frame(5, 12, 20, (300, 100, 20, 4, 1, 0))
    assert len(f) == 32 and f[:4] == b"\x42\x4d\x00\x1c"
    assert int.from_bytes(f[30:], "big") == sum(f[:30])


def test_pms5003_over_a_pty_with_junk_split_frames_and_bad_checksums(pty_port: Pty) -> None:
    good = pms5003.encode_frame(8, 15, 22, (500, 0, 0, 0, 0, 0))
    bad = bytearray(pms5003.encode_frame(1, 1, 1))
    bad[10] ^= 0xFF  # a corrupted data byte
    port = SerialPort(str(pty_port.link), 9600)
    driver = SerialSensor("pm", port, pms5003.PMS5003Parser)

    async def steps(sink: ListSink) -> None:
        pty_port.write(b"\x00\x42\xff junk \x42")  # junk, including a false start
        pty_port.write(good[:13])  # a frame split across two reads
        await asyncio.sleep(0.05)
        pty_port.write(good[13:])
        pty_port.write(bytes(bad))
        pty_port.write(good[:20])  # a partial frame, then a whole one
        pty_port.write(good)

    sink = run_driver(driver, steps, lambda s: len(s.values("pm.pm2_5")) >= 2)
    assert sink.values("pm.pm2_5")[:2] == [15.0, 15.0]
    assert sink.values("pm.pm10")[0] == 22.0 and sink.values("pm.n0_3")[0] == 500.0
    assert "bad_checksum" in sink.fault_kinds()
    assert driver.counters["frames"] >= 2


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 999), st.binary(max_size=8)), min_size=1, max_size=6),
    st.data(),
)
def test_pms5003_parser_finds_every_frame_whatever_the_splits(
    frames: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    junk_free = [j.replace(b"\x42", b"") for _, j in frames]
    stream = b"".join(
        j + pms5003.encode_frame(v, v, v) for (v, _), j in zip(frames, junk_free, strict=True)
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    parser = pms5003.PMS5003Parser()
    out = []
    prev = 0
    for c in [*cuts, len(stream)]:
        out += parser.feed(stream[prev:c])
        prev = c
    assert [f.values["pm2_5"][0] for f in out if isinstance(f, Frame)] == [
        float(v) for v, _ in frames
    ]


# ------------------------------------------------------------------- SDS011


def test_sds011_frames_and_replies(pty_port: Pty) -> None:
    good = sds011.encode_frame(12.3, 45.6)
    assert good[0] == 0xAA and good[1] == 0xC0 and good[-1] == 0xAB
    reply = bytes([0xAA, 0xC5, 0x07, 0x01, 0x00, 0x00, 0xA1, 0xB2, 0x5B, 0xAB])
    bad = bytearray(good)
    bad[8] ^= 1
    port = SerialPort(str(pty_port.link), 9600)
    driver = SerialSensor("sds", port, sds011.SDS011Parser)

    async def steps(sink: ListSink) -> None:
        pty_port.write(b"\x01\x02" + reply + bytes(bad) + good[:4])
        await asyncio.sleep(0.05)
        pty_port.write(good[4:])

    sink = run_driver(driver, steps, lambda s: s.values("sds.pm2_5"))
    assert sink.values("sds.pm2_5") == [12.3] and sink.values("sds.pm10") == [45.6]
    assert sink.fault_kinds().count("bad_checksum") == 1


# --------------------------------------------------------------------- NMEA


def test_nmea_gga_rmc_and_gps_time_over_a_pty(pty_port: Pty) -> None:
    port = SerialPort(str(pty_port.link), 9600)
    driver = SerialSensor("gps", port, nmea.NMEAParser, clock_source="gps")
    corrupt = GGA.replace(b"545.4", b"545.5")  # checksum no longer matches

    async def steps(sink: ListSink) -> None:
        pty_port.write(b"garbage\r\n" + GSV + corrupt + GGA[:30])
        await asyncio.sleep(0.05)
        pty_port.write(GGA[30:] + RMC)

    sink = run_driver(driver, steps, lambda s: s.clocks and s.values("gps.speed"))
    assert sink.values("gps.lat") == [pytest.approx(48.1173)]
    assert sink.values("gps.lon") == [pytest.approx(11.516667, abs=1e-6)]
    assert sink.values("gps.alt") == [545.4]
    assert sink.values("gps.fix") == [1.0] and sink.values("gps.satellites") == [8.0]
    assert sink.clocks[0].utc == datetime(1994, 3, 23, 12, 35, 19, tzinfo=UTC)
    assert sink.clocks[0].source == "gps"
    assert "bad_checksum" in sink.fault_kinds()


@pytest.mark.parametrize("line", [GGA, RMC])
def test_nmea_parser_agrees_with_pynmea2(line: bytes) -> None:
    """pynmea2, an independent parser, reads the same position and time."""
    ours = nmea.NMEAParser().feed(line)
    assert len(ours) == 1 and isinstance(ours[0], Frame)
    theirs = pynmea2.parse(line.decode().strip())
    if ours[0].kind == "GGA":
        assert ours[0].values["lat"][0] == pytest.approx(theirs.latitude, abs=1e-7)
        assert ours[0].values["lon"][0] == pytest.approx(theirs.longitude, abs=1e-7)
        assert ours[0].values["satellites"][0] == int(theirs.num_sats)
    else:
        assert ours[0].utc == theirs.datetime.replace(tzinfo=UTC)


def test_nmea_no_fix_reports_quality_without_position() -> None:
    line = nmea.sentence("GNGGA,000001.00,,,,,0,00,99.99,,,,,,")
    (frame,) = nmea.NMEAParser().feed(line)
    assert isinstance(frame, Frame)
    assert frame.values == {"fix": (0.0, None), "satellites": (0.0, None)}


def test_nmea_missing_checksum_and_overlong_lines_are_errors() -> None:
    p = nmea.NMEAParser()
    out = p.feed(b"$GPGGA,1,2,3\r\n" + b"$" + b"A" * 300)
    assert [e.kind for e in out if isinstance(e, FrameError)] == ["bad_frame", "bad_frame"]


# ------------------------------------------------------- silence and unplug


def test_silent_port_is_reported_as_timeout(pty_port: Pty) -> None:
    port = SerialPort(str(pty_port.link), 9600, read_timeout=0.05)
    driver = SerialSensor("pm", port, pms5003.PMS5003Parser, silence_s=0.2)

    async def steps(sink: ListSink) -> None:
        pass

    sink = run_driver(driver, steps, lambda s: "timeout" in s.fault_kinds(), timeout=5)
    assert "no data for" in sink.faults[0].detail


def test_unplug_and_replug_the_adapter(pty_port: Pty) -> None:
    port = SerialPort(str(pty_port.link), 9600, read_timeout=0.05)
    port.reopen_delay = 0.02
    driver = SerialSensor("pm", port, pms5003.PMS5003Parser)
    frame = pms5003.encode_frame(3, 4, 5)

    async def steps(sink: ListSink) -> None:
        pty_port.write(frame)
        await sink.wait_for(lambda s: s.values("pm.pm2_5"))
        pty_port.write(frame[:10])  # half a frame, then the cable is pulled
        await asyncio.sleep(0.05)
        pty_port.unplug()
        await sink.wait_for(lambda s: "port_error" in s.fault_kinds())
        await asyncio.sleep(0.1)
        pty_port.plug()  # back, possibly as another /dev/pts/N behind the same link
        for _ in range(20):
            pty_port.write(pms5003.encode_frame(6, 7, 8))
            await asyncio.sleep(0.05)
            if len(sink.values("pm.pm2_5")) > 1:
                break

    sink = run_driver(driver, steps, lambda s: len(s.values("pm.pm2_5")) >= 2)
    assert sink.values("pm.pm2_5")[:2] == [4.0, 7.0]
    assert driver.counters["reopened"] >= 1
    assert driver.counters["port_error"] >= 1


def test_interval_reports_only_the_latest_frame(pty_port: Pty) -> None:
    port = SerialPort(str(pty_port.link), 9600)
    driver = SerialSensor("pm", port, pms5003.PMS5003Parser, interval_s=0.3)

    async def steps(sink: ListSink) -> None:
        for v in range(1, 11):
            pty_port.write(pms5003.encode_frame(v, v, v))
            await asyncio.sleep(0.05)

    # Wait for every frame to be parsed (on a loaded machine the second report may come
    # before the last frames are read), then count what was reported.
    sink = run_driver(
        driver,
        steps,
        lambda s: driver.counters["frames"] == 10 and len(s.values("pm.pm2_5")) >= 2,
    )
    assert driver.counters["frames"] == 10
    assert len(sink.values("pm.pm2_5")) < 10


@pytest.mark.parametrize("name", ["pms5003", "sds011", "nmea"])
def test_one_large_read_loses_no_frame(name: str) -> None:
    """A burst far larger than any frame (a port read after a stall) is parsed whole."""
    if name == "pms5003":
        parser, frame = pms5003.PMS5003Parser(), pms5003.encode_frame(1, 2, 3)
    elif name == "sds011":
        parser, frame = sds011.SDS011Parser(), sds011.encode_frame(1.0, 2.0)
    else:
        parser, frame = nmea.NMEAParser(), GGA
    out = parser.feed(frame * 1000)
    assert len(out) == 1000 and all(isinstance(f, Frame) for f in out)
    assert len(parser.buf) == 0
